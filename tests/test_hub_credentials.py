"""Credentials stay off disk: a Hub token given with `--hub_token` to any of the four example scripts is in no file the
run writes (pickles such as `training_args.bin` included), in nothing it uploads and in nothing it prints; it reaches
the Hub in the Authorization header only. The Hub is `tests/fake_hub.py` on 127.0.0.1 (`HF_ENDPOINT`), which records
every request. Also: `veca_hf.hub.access.take_credentials` on its own and in each script, and model cards without a
URL's credentials."""

import importlib.util
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import pytest
import torch
from conftest import tiny_config
from fake_hub import FakeHub
from huggingface_hub import ModelCard
from test_dense_finetune import COMMON, ID2LABEL, veca_folder, write_parquet_dataset  # noqa: F401 (a fixture)
from test_distill_script import distill_args, workspace  # noqa: F401 (a fixture)
from test_finetune import write_image_folder
from transformers import TrainingArguments

from veca_hf import VecaImageProcessor, VecaModel
from veca_hf.hub.access import take_credentials
from veca_hf.hub.cards import write_model_card


REPO = Path(__file__).resolve().parents[1]
TOKEN = "hf_FAKEtokenNEVERonDISKorINlogs0123456789"
SCRIPTS = ("finetune_classification", "finetune_segmentation", "finetune_depth", "distill")
HUB = ["--push_to_hub", "--hub_model_id", "me/x", "--hub_token", TOKEN]
# One step, then a checkpoint (which Trainer also pushes), evaluation at one budget.
ONE_STEP = ["--max_steps", "1", "--save_strategy", "steps", "--save_steps", "1", "--eval_budgets", "8"]


@pytest.fixture(scope="module")
def hub():
    with FakeHub() as server:
        yield server


def script_arguments(name: str, root: Path, request) -> list[str]:
    """The tiny run of `examples/<name>.py` writing into `root / "out"`, the data and model made under `root`."""
    output = ["--output_dir", str(root / "out")]
    if name == "finetune_classification":
        write_image_folder(root / "train", per_class=2, seed=0)
        write_image_folder(root / "validation", per_class=1, seed=1)
        VecaModel(tiny_config()).save_pretrained(root / "tiny")
        VecaImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(
            root / "tiny"
        )
        return [
            "--model_name_or_path", str(root / "tiny"), "--train_dir", str(root / "train"),
            "--validation_dir", str(root / "validation"), *output, "--do_train", "--do_eval",
            "--num_core_tokens", "8", "--per_device_train_batch_size", "6", "--use_cpu", "--report_to", "none",
            "--dataloader_num_workers", "0", "--disable_tqdm", "true", *ONE_STEP,
        ]  # fmt: skip
    if name == "distill":
        return distill_args(request.getfixturevalue("workspace"), root / "out", max_train_steps=1,
                            checkpointing_steps=1, validation_steps=1, model_card_latency="false")  # fmt: skip
    data = write_parquet_dataset(root / "data", {"train": 4, "validation": 2}, depth_as_png=name == "finetune_depth")
    (data / "id2label.json").write_text(json.dumps({str(k): v for k, v in ID2LABEL.items()}))
    model = ["--model_name_or_path", str(request.getfixturevalue("veca_folder")), "--head", "linear"]
    return [*model, "--dataset_name", str(data), *output, *COMMON, "--num_core_tokens", "8", *ONE_STEP]


@pytest.mark.processes
@pytest.mark.parametrize("name", SCRIPTS)
def test_hub_token_reaches_the_hub_only_in_the_authorization_header(name, hub, tmp_path, request):
    """The script pushes to the fake Hub with `--hub_token`: the commit (with the weights) is authenticated by the
    token, and no file under the run's folders, no request body, no other header and no output line holds it."""
    hub.clear()
    arguments = script_arguments(name, tmp_path, request) + HUB
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.pop("HF_HUB_DISABLE_IMPLICIT_TOKEN", None)
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HUB_OFFLINE="0",
        HF_HOME=str(tmp_path / "hf-home"),  # no cached login: the flag is the only token
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "datasets-cache"),
        HF_MODULES_CACHE=str(tmp_path / "modules"),
        HF_HUB_DISABLE_TELEMETRY="1",
        ACCELERATE_USE_CPU="true",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    command = [sys.executable, str(REPO / "examples" / f"{name}.py"), *arguments]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]

    # The upload happened, authenticated by the token, and asked only for what the fake Hub answers.
    assert hub.unhandled == []
    assert hub.repos == {"me/x"}
    uploaded = {path for commit in hub.commits for path in commit.files}
    assert "model.safetensors" in uploaded and "README.md" in uploaded, uploaded
    assert {(commit.repo_id, commit.authorization) for commit in hub.commits} == {("me/x", f"Bearer {TOKEN}")}

    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    if name != "distill":  # Trainer's pickle of its arguments, in the folder, in the checkpoint and in the upload
        assert (tmp_path / "out" / "training_args.bin").is_file()
        assert (tmp_path / "out" / "checkpoint-1" / "training_args.bin").is_file()
        assert "training_args.bin" in uploaded
        assert "prefer `hf auth login` or the HF_TOKEN environment variable" in result.stderr  # the warning
    # Every place the token could have gone, listed together (a failure names them all).
    leaks = [str(path) for path in written if TOKEN.encode() in path.read_bytes()]
    for index, sent in enumerate(hub.requests):
        where = f"request {index} ({sent.method} {sent.path})"
        leaks += [f"{where}: path"] if TOKEN in sent.path else []
        leaks += [f"{where}: header {key}" for key, value in sent.headers.items()
                  if key.lower() != "authorization" and TOKEN in value]  # fmt: skip
        if TOKEN.encode() in sent.body or any(TOKEN.encode() in part for part in sent.decoded_parts()):
            leaks.append(f"{where}: body")
    leaks += [f"the script's {stream}" for stream, text in (("stdout", result.stdout), ("stderr", result.stderr))
              if TOKEN in text]  # fmt: skip
    assert leaks == [], "the token is in:\n" + "\n".join(leaks)
    # Every card uploaded (Trainer's, then VECA's) names the model and the data without this machine's paths.
    cards = [commit.files["README.md"].decode() for commit in hub.commits if "README.md" in commit.files]
    assert cards and not [card for card in cards if str(tmp_path.parent) in card], cards


@dataclass
class HubArguments:
    hub_token: str | None = None
    storage_options: str | None = None
    seed: int = 0


def test_take_credentials_moves_the_token_to_this_process_only(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("HF_TOKEN", "restored after the test")
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(sys, "argv", ["script.py", "--hub_token", TOKEN, f"--hub_token={TOKEN}", "--seed", "0"])
    args = TrainingArguments(output_dir=str(tmp_path), push_to_hub=True, hub_token=TOKEN, report_to="none")
    with caplog.at_level(logging.WARNING):
        take_credentials(args)
    assert args.hub_token is None and os.environ["HF_TOKEN"] == TOKEN
    assert sys.argv == ["script.py", "--hub_token", "<HUB_TOKEN>", "--hub_token=<HUB_TOKEN>", "--seed", "0"]
    assert "hf auth login" in caplog.text and "HF_TOKEN" in caplog.text and TOKEN not in caplog.text
    torch.save(args, tmp_path / "training_args.bin")  # what Trainer writes
    assert TOKEN.encode() not in (tmp_path / "training_args.bin").read_bytes()
    # without the flag nothing changes and nothing is logged
    monkeypatch.setenv("HF_TOKEN", "hf_fromTheEnvironment")
    caplog.clear()
    take_credentials(TrainingArguments(output_dir=str(tmp_path), report_to="none"))
    assert os.environ["HF_TOKEN"] == "hf_fromTheEnvironment" and caplog.text == ""
    # huggingface_hub told to send no implicit token would not send HF_TOKEN: an error now, not after training
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)
    args = TrainingArguments(output_dir=str(tmp_path), push_to_hub=True, hub_token=TOKEN, report_to="none")
    with pytest.raises(ValueError, match="unset HF_HUB_DISABLE_IMPLICIT_TOKEN"):
        take_credentials(args)


def test_take_credentials_clears_abbreviated_flags_and_keeps_what_the_run_needs(monkeypatch):
    """argparse takes `--hub_tok` and `--storage_opt` for the full names: the values are found as parsed."""
    monkeypatch.setenv("HF_TOKEN", "restored after the test")
    options = json.dumps({"key": "FAKEsecret42"})
    monkeypatch.setattr(sys, "argv", ["script.py", "--hub_tok", TOKEN, f"--storage_opt={options}", "--seed", "0"])
    args = HubArguments(hub_token=TOKEN, storage_options=options)
    take_credentials(args)
    assert sys.argv == ["script.py", "--hub_tok", "<HUB_TOKEN>", f"--storage_opt={json.dumps({'key': '<REDACTED>'})}",
                        "--seed", "0"]  # fmt: skip
    assert args.storage_options == options  # the run reads the shards with them


class Parsed(Exception):
    """Raised where a script would start its work: the command line has been parsed and its credentials taken."""


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["distill", "extract_features", "finetune_classification"])
def test_every_script_takes_its_credentials_off_the_command_line(name, monkeypatch, tmp_path):
    """What trackers record of the command line (`sys.argv`, wandb) holds no token, storage key or URL password."""
    monkeypatch.setenv("HF_TOKEN", "restored after the test")
    monkeypatch.delenv("HF_TOKEN")
    script = _load_script(name)
    url = "https://user:FAKEpassword42@data.example.com/shard-{0..3}.tar"
    options = ["--storage_options", json.dumps({"key": "FAKEkey42", "secret": "FAKEsecret42"})]
    output = ["--output_dir", str(tmp_path / "out")]
    hub = ["--push_to_hub", "--hub_token", TOKEN]
    if name == "distill":  # stops where the Accelerator would be built
        monkeypatch.setattr(script, "build_accelerator", lambda *args: (_ for _ in ()).throw(Parsed()))
        argv, run = ["--dataset_name", url, *options, *output, *hub], script.main
    elif name == "extract_features":
        monkeypatch.setattr(script, "Accelerator", lambda *args: (_ for _ in ()).throw(Parsed()))
        argv, run = ["--model_name_or_path", "m", "--dataset_name", url, *options, *output], script.main
    else:  # the fine-tuning scripts share their parsing
        import veca_hf.training.scripts as scripts

        monkeypatch.setattr(scripts, "tune_cpu_allocator", lambda: None)
        monkeypatch.setattr(scripts, "setup_logging", lambda *args: (_ for _ in ()).throw(Parsed()))
        argv = ["--model_name_or_path", "m", "--dataset_name", url, *output, "--do_train", "--report_to", "none", *hub]

        def run():
            scripts.parse_finetuning_args((script.ModelArguments, script.DataTrainingArguments), script.logger)

    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    with pytest.raises(Parsed):
        run()
    recorded = " ".join(sys.argv)
    for secret in (TOKEN, "FAKEpassword42", "FAKEkey42", "FAKEsecret42"):
        assert secret not in recorded, (secret, sys.argv)
    assert "https://<REDACTED>@data.example.com/shard-{0..3}.tar" in sys.argv
    if "--hub_token" in argv:
        assert os.environ["HF_TOKEN"] == TOKEN and "<HUB_TOKEN>" in sys.argv


def test_model_card_names_a_url_dataset_without_its_credentials(tmp_path):
    folder = tmp_path / "veca-tiny"
    VecaModel(tiny_config()).save_pretrained(folder)
    url = "https://user:s3cret@data.example.com/shards/train.parquet?X-Amz-Signature=abc123&sig=def456"
    write_model_card(folder, datasets=["ILSVRC/imagenet-1k", url], measure_latency=False, resolutions=(64,))
    text = (folder / "README.md").read_text()
    assert "- `https://data.example.com/shards/train.parquet`" in text
    assert "s3cret" not in text and "abc123" not in text and "def456" not in text and "user:" not in text
    assert ModelCard.load(folder / "README.md").data.datasets == ["ILSVRC/imagenet-1k"]
