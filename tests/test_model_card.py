"""Model cards (`veca_hf.hub.cards`) and the converter's Hub flags. The Hub is never called: uploads are faked."""

from types import SimpleNamespace

import huggingface_hub
import pytest
from conftest import FIXTURES, tiny_config
from huggingface_hub import ModelCard

from veca_hf import VecaConfig, VecaForImageClassification, VecaImageProcessor, VecaModel
from veca_hf.flops import veca_model_flops
from veca_hf.hub.cards import (
    DINOV3_LICENSE,
    base_model_license,
    budget_metrics_from_results,
    preset_teacher,
    push_to_hub,
    resolve_hub_model_id,
    write_model_card,
)
from veca_hf.hub.convert_veca_original import main as convert_main


TEACHER = "facebook/dinov3-vits16-pretrain-lvd1689m"


@pytest.fixture
def tiny_folder(tmp_path):
    VecaModel(tiny_config()).save_pretrained(tmp_path / "veca-tiny")
    VecaImageProcessor().save_pretrained(tmp_path / "veca-tiny")
    return tmp_path / "veca-tiny"


@pytest.fixture
def fake_hub(monkeypatch):
    """Records `create_repo` / `upload_folder` calls instead of reaching the Hub; the user namespace is `me`."""
    calls = {"create_repo": [], "upload_folder": []}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"].append((repo_id, kwargs))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id if '/' in repo_id else 'me/' + repo_id}")

    def upload_folder(self, **kwargs):
        calls["upload_folder"].append(kwargs)

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    return calls


def test_card_metadata_parses_back(tiny_folder):
    write_model_card(
        tiny_folder,
        base_model=TEACHER,
        datasets=["ILSVRC/imagenet-1k", str(tiny_folder)],  # a Hub id and a local folder
        budget_metrics={8: {"loss": 0.25}, 16: {"loss": 0.125}},
        resolutions=(64, 128),
        latency_repeats=1,
    )
    card = ModelCard.load(tiny_folder / "README.md")
    assert card.data.license == "other" and card.data.license_name == "dinov3-license"  # the DINOv3 teacher's
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "image-feature-extraction"
    assert {"veca", "vision", "custom_code"} <= set(card.data.tags)
    assert card.data.base_model == TEACHER
    assert card.data.datasets == ["ILSVRC/imagenet-1k"]  # local paths stay out of the metadata and the text
    assert str(tiny_folder) not in card.text and "- a local folder" in card.text


def test_card_has_a_row_per_budget_with_flops_and_latency(tiny_folder):
    config = VecaConfig.from_pretrained(tiny_folder)
    card = write_model_card(
        tiny_folder, budget_metrics={8: {"accuracy": 0.5}}, resolutions=(64, 128), latency_repeats=1
    )
    lines = card.text.splitlines()
    header = next(line for line in lines if line.startswith("| budget C"))
    assert header == (
        "| budget C | accuracy | GFLOPs @ 64 px | GFLOPs @ 128 px | latency (ms) @ 64 px | latency (ms) @ 128 px |"
    )
    for budget in config.budgets:
        row = next(line for line in lines if line.startswith(f"| {budget} |")).strip("| ").split(" | ")
        assert row[1] == ("0.5000" if budget == 8 else "–")  # quality only where measured
        assert row[2:4] == [f"{veca_model_flops(config, r, r, budget) / 1e9:.2f}" for r in (64, 128)]
        assert all(float(value) > 0 for value in row[4:6])
    assert "pick_budget(model" in card.text and "trust_remote_code=True" in card.text
    assert 'AutoModel.from_pretrained("veca-tiny")' in card.text


def test_latency_can_be_left_out(tiny_folder):
    card = write_model_card(tiny_folder, measure_latency=False)
    assert "latency (ms)" not in card.text and "Latency: not measured" in card.text
    assert "GFLOPs @ 256 px" in card.text and "GFLOPs @ 512 px" in card.text  # the default resolutions


def test_classifier_card(tmp_path):
    VecaForImageClassification(tiny_config(num_labels=3)).save_pretrained(tmp_path / "clf")
    card = write_model_card(
        tmp_path / "clf", base_model=str(tmp_path), model_id="me/veca-tiny-clf", measure_latency=False,
        training_details={"learning_rate": 1e-3},
    )  # fmt: skip
    assert card.data.pipeline_tag == "image-classification"
    assert card.data.base_model is None  # a local folder is not a Hub repository
    assert 'AutoModelForImageClassification.from_pretrained("me/veca-tiny-clf")' in card.text
    assert "| learning_rate | 0.001 |" in card.text and "| labels | 3 |" in card.text


def test_invalid_card_arguments(tiny_folder):
    with pytest.raises(ValueError, match="not a valid budget"):
        write_model_card(tiny_folder, budget_metrics={12: {"accuracy": 0.5}}, measure_latency=False)
    with pytest.raises(ValueError, match="not a multiple of patch_size=16"):
        write_model_card(tiny_folder, resolutions=(100, 512), measure_latency=False)


def test_budget_metrics_from_evaluate_budgets_results():
    results = {"eval_C8_accuracy": 0.5, "eval_C8_loss": 1.0, "eval_C8_runtime": 3.0, "eval_C16_accuracy": 0.75,
               "train_loss": 2.0, "epoch": 1.0}  # fmt: skip
    assert budget_metrics_from_results(results) == {8: {"accuracy": 0.5, "loss": 1.0}, 16: {"accuracy": 0.75}}


def test_preset_teacher():
    assert preset_teacher(VecaConfig.from_preset("veca-b16")) == "facebook/dinov3-vitb16-pretrain-lvd1689m"
    assert preset_teacher(tiny_config()) is None


def test_hub_arguments():
    assert resolve_hub_model_id("outputs/veca-b16", push_to_hub=False) is None
    assert resolve_hub_model_id("outputs/veca-b16", push_to_hub=True) == "veca-b16"  # as Trainer does
    assert resolve_hub_model_id("outputs/veca-b16", push_to_hub=True, hub_model_id="org/x") == "org/x"
    with pytest.raises(ValueError, match="--hub_model_id given without --push_to_hub"):
        resolve_hub_model_id("out", push_to_hub=False, hub_model_id="org/x")
    with pytest.raises(ValueError, match="--hub_token given without --push_to_hub"):
        resolve_hub_model_id("out", push_to_hub=False, hub_token="hf_x")


def test_push_to_hub_uploads_the_folder_without_checkpoints(tiny_folder, fake_hub):
    assert push_to_hub(tiny_folder, "veca-tiny", private=True) == "me/veca-tiny"
    assert fake_hub["create_repo"] == [("veca-tiny", {"private": True, "exist_ok": True})]
    (upload,) = fake_hub["upload_folder"]
    assert upload["repo_id"] == "me/veca-tiny" and upload["folder_path"] == str(tiny_folder)
    assert "checkpoints/*" in upload["ignore_patterns"] and "checkpoint-*" in upload["ignore_patterns"]
    with pytest.raises(ValueError, match="holds no config.json"):
        push_to_hub(tiny_folder / "missing", "x")


def test_converter_writes_a_card(tmp_path, fake_hub):
    output_dir = tmp_path / "converted"
    convert_main(["--checkpoint", str(FIXTURES / "tiny_reference.pth"), "--output-dir", str(output_dir),
                  "--base_model", TEACHER, "--dataset", "ILSVRC/imagenet-1k", "--no_latency"])  # fmt: skip
    card = ModelCard.load(output_dir / "README.md")
    assert card.data.base_model == TEACHER and card.data.datasets == ["ILSVRC/imagenet-1k"]
    assert "tiny_reference.pth" in card.text and "| 16 |" in card.text
    assert fake_hub == {"create_repo": [], "upload_folder": []}  # no push without --push_to_hub
    assert card.data.to_dict()["license_link"] == DINOV3_LICENSE["license_link"]  # follows the teacher by default


@pytest.mark.parametrize(
    "flags, license",
    [
        ([], {"license": "other"}),  # the tiny fixture matches no preset: no teacher, no known license
        (["--base_model", "facebook/dinov2-base"], {"license": "apache-2.0"}),
        (["--base_model", TEACHER, "--license", "mit"], {"license": "mit"}),  # the flag always wins
    ],
)
def test_converter_license_follows_the_base_model_unless_given(tmp_path, flags, license):
    output_dir = tmp_path / "converted"
    convert_main(["--checkpoint", str(FIXTURES / "tiny_reference.pth"), "--output-dir", str(output_dir),
                  "--no_latency", *flags])  # fmt: skip
    metadata = ModelCard.load(output_dir / "README.md").data.to_dict()
    assert {key: metadata[key] for key in ("license", "license_name", "license_link") if key in metadata} == license


def test_converter_pushes_to_the_output_folder_name(tmp_path, fake_hub, capsys):
    output_dir = tmp_path / "veca-tiny-converted"
    token = "hf_FAKEconverterTOKEN0123456789"
    convert_main(["--checkpoint", str(FIXTURES / "tiny_reference.pth"), "--output-dir", str(output_dir),
                  "--push_to_hub", "--hub_token", token, "--no_latency"])  # fmt: skip
    # the token is used, never written or printed
    assert not [p for p in output_dir.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    # created before converting (a bad login fails at once), under the output folder's name
    assert fake_hub["create_repo"][0][0] == "veca-tiny-converted"
    (upload,) = fake_hub["upload_folder"]
    assert upload["repo_id"] == "me/veca-tiny-converted" and upload["folder_path"] == str(output_dir)
    card = ModelCard.load(output_dir / "README.md")
    assert 'AutoModel.from_pretrained("me/veca-tiny-converted")' in card.text  # the full id, known before the card
    assert card.data.base_model is None  # the tiny fixture matches no preset, so no teacher is claimed
    out, err = capsys.readouterr()
    assert "https://huggingface.co/me/veca-tiny-converted" in out and token not in out + err


def test_converter_refuses_hub_flags_without_push(tmp_path, fake_hub, capsys):
    output_dir = tmp_path / "converted"
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--checkpoint", str(FIXTURES / "tiny_reference.pth"), "--output-dir", str(output_dir),
                      "--hub_model_id", "me/x"])  # fmt: skip
    assert exit_info.value.code == 2
    assert "--hub_model_id given without --push_to_hub" in capsys.readouterr().err
    assert not output_dir.exists() and fake_hub["create_repo"] == []  # refused before any work


def test_default_resolutions_follow_the_patch_size(tmp_path):
    """A patch-14 student (the DINOv2 teacher's grid) gets 224 and 448 px columns instead of failing on 256."""
    tiny_config(patch_size=14).save_pretrained(tmp_path)
    card = write_model_card(tmp_path, measure_latency=False)
    assert "GFLOPs @ 224 px" in card.text and "GFLOPs @ 448 px" in card.text


def test_card_names_hub_ids_never_local_paths(tiny_folder, tmp_path, monkeypatch):
    """A public card names a Hub id, a URL without its credentials, or "a local folder": never this machine's paths."""
    teacher = tmp_path / "home" / "me" / ".cache" / "veca_hf" / "teacher"
    teacher.mkdir(parents=True)
    (tmp_path / "photos").mkdir()
    monkeypatch.chdir(tmp_path)  # "photos" is a local folder here, though it is spelled like a Hub id
    url = "https://user:FAKEsecret42@data.example.com/a-{0,1}.parquet?sig=FAKEsecret42#token=FAKEsecret42"
    datasets = ["ILSVRC/imagenet-1k", "photos", str(tmp_path / "shards" / "train-*.parquet"), "~/data/train", url]
    card = write_model_card(tiny_folder, base_model=str(teacher), datasets=datasets, measure_latency=False)
    text = (tiny_folder / "README.md").read_text()
    for local in (str(tmp_path), "/home/", ".cache", "~/data", "photos", "FAKEsecret42", "user"):
        assert local not in text, local
    assert "| base model | a local folder |" in text and "derive from a local folder" in text
    assert "- `ILSVRC/imagenet-1k`\n- a local folder\n- local files\n- local files\n" in text
    assert "- `https://data.example.com/a-{0,1}.parquet`" in text
    assert card.data.base_model is None and card.data.datasets == ["ILSVRC/imagenet-1k"]

    card = write_model_card(tiny_folder, base_model=TEACHER, datasets="ILSVRC/imagenet-1k", measure_latency=False)
    assert f"| base model | [`{TEACHER}`](https://huggingface.co/{TEACHER}) |" in card.text
    assert card.data.base_model == TEACHER


@pytest.mark.parametrize("hub", [False, True])
def test_trainers_own_card_names_no_local_path(tmp_path, hub):
    """`Trainer.push_to_hub` uploads its own card before the VECA card replaces it: it gets Hub ids only."""
    from veca_hf.arguments import BudgetArguments
    from veca_hf.training.scripts import train_evaluate_and_publish

    pushed = {}

    class FakeTrainer:
        args = SimpleNamespace(do_train=False, do_eval=False, push_to_hub=True, output_dir=str(tmp_path / "out"))
        model = VecaModel(tiny_config())

        def push_to_hub(self, **kwargs):
            pushed.update(kwargs)

        def is_world_process_zero(self):
            return True

    (tmp_path / "data").mkdir()
    base_model, dataset = (TEACHER, "ILSVRC/imagenet-1k") if hub else (str(tmp_path), str(tmp_path / "data"))
    train_evaluate_and_publish(
        FakeTrainer(), BudgetArguments(), base_model=base_model, datasets=dataset, hub_dataset=dataset,
        task="image-classification", metrics_description="", description="",
    )  # fmt: skip
    assert (pushed["finetuned_from"], pushed["dataset"]) == ((TEACHER, "ILSVRC/imagenet-1k") if hub else (None, None))


@pytest.mark.parametrize(
    "base_model, metadata",
    [
        (TEACHER, DINOV3_LICENSE),
        ("facebook/dinov3-vit7b16-pretrain-sat493m", DINOV3_LICENSE),
        ("facebook/dinov2-with-registers-base", {"license": "apache-2.0"}),
        ("someone/veca-b16", {"license": "other"}),  # a Hub model whose license this code does not know
        ("local", {"license": "other"}),  # a local folder
        (None, {"license": "other"}),
    ],
)
def test_card_license_follows_the_base_model(tiny_folder, tmp_path, monkeypatch, caplog, base_model, metadata):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()
    with caplog.at_level("WARNING"):
        card = write_model_card(tiny_folder, base_model=base_model, measure_latency=False)
    written = ModelCard.load(tiny_folder / "README.md").data.to_dict()
    assert {key: written[key] for key in ("license", "license_name", "license_link") if key in written} == metadata
    license_text = card.text.split("## License\n\n")[1].split("\n\n## ")[0]
    known = base_model_license(base_model) is not None
    assert known == ("Not set" not in license_text)
    assert known == (not any("the license is not set" in message for message in caplog.messages))
    if metadata is DINOV3_LICENSE:
        assert f"[DINOv3 License]({DINOV3_LICENSE['license_link']})" in license_text and base_model in license_text
    if not known:  # tells the user how to set it, naming the base model the way the card does
        assert "license=" in license_text and "--license" in license_text
        assert ("a local folder" in license_text) == (base_model == "local")


def test_an_explicit_license_always_wins(tiny_folder):
    card = write_model_card(tiny_folder, base_model=TEACHER, license="mit", measure_latency=False)
    written = ModelCard.load(tiny_folder / "README.md").data.to_dict()
    assert written["license"] == "mit" and "license_name" not in written and "license_link" not in written
    assert "## License\n\n`mit`." in card.text
