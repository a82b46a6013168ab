"""Argument files for the example scripts (`veca_hf.arguments.parse_args_with_file`): one loader for all of them."""

import importlib
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from veca_hf.arguments import parse_args_with_file
from veca_hf.training.distillation import PAPER_STAGE2_RESOLUTION_SCHEDULE


ROOT = Path(__file__).parent.parent


@dataclass
class FirstArguments:
    name: str = "default"
    limit: int | None = field(default=3, metadata={"help": "An optional int."})
    split: str | None = "validation"
    rate: float = 0.1


@dataclass
class SecondArguments:
    steps: int = 10
    verbose: bool = False
    fast: bool = True
    required: str = field(default=None, metadata={"help": "No default in the scripts' sense."})


def parse(argv):
    return parse_args_with_file(HfArgumentParser((FirstArguments, SecondArguments)), argv)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_nulls_are_none_and_flags_override_the_file(tmp_path, suffix):
    values = {"limit": None, "split": None, "rate": 0.5, "steps": 20, "verbose": True, "fast": False}
    path = tmp_path / f"args{suffix}"
    path.write_text(json.dumps(values))  # JSON is YAML too
    first, second = parse([str(path)])
    assert first.limit is None and first.split is None  # not 'None', and no int('None') failure
    assert (first.name, first.rate, second.steps, second.verbose, second.fast) == ("default", 0.5, 20, True, False)

    first, second = parse([str(path), "--limit", "7", "--steps", "30", "--split", "test", "--fast"])
    assert (first.limit, second.steps, first.split, second.fast) == (7, 30, "test", True)
    assert first.rate == 0.5 and second.verbose  # the file's values that no flag overrides


def test_file_values_written_as_text_get_the_flag_type(tmp_path):
    path = tmp_path / "args.yaml"
    path.write_text("rate: 1e-3\nsteps: '12'\nname: 42\n")  # YAML reads 1e-3 as a string
    first, second = parse([str(path)])
    assert (first.rate, second.steps, first.name) == (0.001, 12, "42")


def test_bad_files_and_flags(tmp_path):
    path = tmp_path / "args.yaml"
    path.write_text("steps: 1\nbogus: 2\n")
    with pytest.raises(ValueError, match=r"args.yaml.*bogus"):
        parse([str(path)])
    path.write_text("steps: many\n")
    with pytest.raises(ValueError, match=r"steps='many' in .*args.yaml"):
        parse([str(path)])
    path.write_text("- steps\n")
    with pytest.raises(ValueError, match="mapping"):
        parse([str(path)])
    path.write_text("steps: 1\n")
    with pytest.raises(SystemExit):  # argparse's own error for an unknown flag
        parse([str(path), "--bogus", "1"])


def test_a_field_without_default_may_come_from_the_file_or_a_flag(tmp_path):
    @dataclass
    class Needed:
        model: str
        steps: int = 1

    parser = HfArgumentParser(Needed)
    path = tmp_path / "args.yaml"
    path.write_text("steps: 2\n")
    assert parse_args_with_file(parser, [str(path), "--model", "m"])[0] == Needed("m", 2)
    with pytest.raises(ValueError, match="model.*give it in the file or as a flag"):
        parse_args_with_file(parser, [str(path)])


def test_without_a_file_it_is_plain_flags():
    first, second = parse(["--limit", "5", "--verbose"])
    assert first.limit == 5 and second.verbose and first.split == "validation"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_distill_script_reads_nulls_from_its_file(tmp_path):
    path = tmp_path / "args.yaml"
    path.write_text(
        "dataset_name: images\nvalidation_split: null\ncheckpoints_total_limit: null\n"
        "teacher_micro_batch_size: null\nmax_train_steps: 5\nlearning_rate: 1e-3\nresolution: 224\n"
    )
    model_args, data_args, args = _load_script("distill").parse_args([str(path), "--max_train_steps", "1"])
    assert data_args.validation_split is None and args.checkpoints_total_limit is None
    assert model_args.teacher_micro_batch_size is None
    assert (args.max_train_steps, args.learning_rate, data_args.resolution) == (1, 1e-3, "224")
    assert args.mixed_precision is None and args.budgets is None  # left to the launcher / the student


@pytest.mark.parametrize(
    "flag, value", [("logging_steps", "0"), ("max_train_steps", "0"), ("validation_steps", "-1"),
                    ("per_device_train_batch_size", "0"), ("gradient_accumulation_steps", "0")],
)  # fmt: skip
def test_distill_script_refuses_a_step_count_it_would_divide_by(flag, value):
    with pytest.raises(ValueError, match=f"--{flag} must be at least .*, got {value}"):
        _load_script("distill").parse_args(["--dataset_name", "images", f"--{flag}", value])


def test_distill_script_validates_at_the_end_only_with_validation_steps_0():
    args = _load_script("distill").parse_args(["--dataset_name", "images", "--validation_steps", "0"])[2]
    assert args.validation_steps == 0 and args.checkpointing_steps == 500


def test_every_example_loads_files_with_the_package_loader():
    import inspect

    from veca_hf.training.scripts import parse_finetuning_args

    assert "parse_args_with_file(" in inspect.getsource(parse_finetuning_args)
    for name in ("distill", "finetune_classification", "finetune_segmentation", "finetune_depth", "linear_probe"):
        source = (ROOT / "examples" / f"{name}.py").read_text()
        assert "parse_args_with_file(" in source or "parse_finetuning_args(" in source, name
        assert "parse_yaml_file" not in source and "parse_json_file" not in source, name


def test_paper_recipe_files_hold_the_papers_two_stages():
    distill = _load_script("distill")
    configs = ROOT / "examples" / "configs"
    model, data, args = distill.parse_args([str(configs / "paper_stage1.yaml"), "--dataset_name", "my/objects365"])
    assert (model.teacher_name_or_path, model.student_preset) == (
        "facebook/dinov3-vitb16-pretrain-lvd1689m",
        "veca-b16",
    )
    assert model.init_patch_embeddings_from_teacher == "yes" and data.resolution == "256"
    assert (args.optimizer, args.learning_rate, args.min_learning_rate, args.weight_decay) == (
        "normuon",
        4e-4,
        5e-5,
        0.015,
    )
    assert args.warmup_from_min_learning_rate and args.per_device_train_batch_size * 6 == 768
    assert args.budgets is None and args.budget_weights is None  # the defaults: 8..64 weighted 1,1,2,2,3,3,4,4

    model, data, args = distill.parse_args([str(configs / "paper_stage2.yaml"), "--dataset_name", "my/objects365"])
    assert model.student_name_or_path == "outputs/veca-b16-stage1" and model.init_patch_embeddings_from_teacher == "no"
    assert data.resolution == PAPER_STAGE2_RESOLUTION_SCHEDULE
    assert (args.optimizer, args.learning_rate, args.min_learning_rate, args.weight_decay) == (
        "normuon",
        8e-5,
        3e-5,
        0.01,
    )
    assert args.max_train_steps == 50_000 and args.warmup_from_min_learning_rate


def test_redact_secrets_hides_tokens_and_storage_keys_at_any_depth():
    from veca_hf.arguments import redact_secrets

    values = {
        "hub_token": "hf_abc", "learning_rate": 1e-3, "push_to_hub": True, "hub_model_id": "me/x",
        "storage_options": '{"key": "AKIA123", "secret": "s3cr3t", "client_kwargs": {"endpoint_url": "http://127.0.0.1"}}',
        "nested": {"aws_secret_access_key": "s3cr3t", "token": None, "items": [{"password": "p"}]},
    }  # fmt: skip
    redacted = redact_secrets(values)
    assert redacted["hub_token"] == "<HUB_TOKEN>" and redacted["learning_rate"] == 1e-3 and redacted["push_to_hub"]
    assert json.loads(redacted["storage_options"]) == {  # every option's whole value: its names stay
        "key": "<REDACTED>",
        "secret": "<REDACTED>",
        "client_kwargs": "<REDACTED>",
    }
    assert redacted["nested"] == {
        "aws_secret_access_key": "<REDACTED>",
        "token": None,
        "items": [{"password": "<REDACTED>"}],
    }
    assert "hf_abc" not in json.dumps(redacted) and "s3cr3t" not in json.dumps(redacted)
    assert values["hub_token"] == "hf_abc"  # a copy


@pytest.mark.parametrize(
    "options",
    [
        {"headers": {"Authorization": "Bearer FAKEsecret42", "Cookie": "session=FAKEsecret42"}},
        {"passwd": "FAKEsecret42"}, {"auth": ["user", "FAKEsecret42"]},
        {"client_kwargs": {"aws_session_token": "FAKEsecret42"}}, {"https": {"token": "FAKEsecret42"}},
    ],
)  # fmt: skip
def test_every_storage_option_value_is_redacted(options):
    from veca_hf.arguments import redact_secrets

    for value in (json.dumps(options), options):  # the flag's JSON, or a dict from an arguments file
        redacted = redact_secrets({"storage_options": value, "num_core_tokens": 8})
        assert "FAKEsecret42" not in json.dumps(redacted)
        assert set(
            json.loads(redacted["storage_options"]) if isinstance(value, str) else redacted["storage_options"]
        ) == set(options)
        assert redacted["num_core_tokens"] == 8  # a count, not a credential


@pytest.mark.parametrize(
    "url, shown",
    [
        ("https://user:FAKEsecret42@host/data/shard-{00000..00003}.parquet",
         "https://<REDACTED>@host/data/shard-{00000..00003}.parquet"),
        ("https://bucket.s3.amazonaws.com/a.tar?X-Amz-Signature=FAKEsecret42&X-Amz-Date=1",
         "https://bucket.s3.amazonaws.com/a.tar?<REDACTED>"),
        ("https://acct.blob.core.windows.net/c/a.parquet?sig=FAKEsecret42", "https://acct.blob.core.windows.net/c/a.parquet?<REDACTED>"),
        ("http://h:80/v.parquet?token=FAKEsecret42", "http://h:80/v.parquet?<REDACTED>"),
        ("hf://datasets/org/name@refs%2Fconvert%2Fparquet/default/train/*.parquet",
         "hf://datasets/org/name@refs%2Fconvert%2Fparquet/default/train/*.parquet"),
    ],
)  # fmt: skip
def test_urls_lose_user_info_and_query_strings_wherever_they_appear(url, shown):
    from veca_hf.arguments import redact_secrets, redact_urls

    assert redact_urls(url) == shown
    assert redact_urls(f"Unable to find '{url}' (503)") == f"Unable to find '{shown}' (503)"
    redacted = redact_secrets({"dataset_name": url, "validation_split": f"{url},{url}", "nested": [{"url": url}]})
    assert redacted == {"dataset_name": shown, "validation_split": f"{shown},{shown}", "nested": [{"url": shown}]}


SECRET = "FAKEsecret42"


@pytest.mark.parametrize("mark", [",", "@", " ", "'", '"', "?", "#", "/", "%40"])
def test_every_password_urllib_reads_is_redacted(mark):
    """A password may hold any of these: what urllib reads as user info (up to the netloc's last `@`) never shows.
    `?`, `#` and `/` end the netloc for urllib, which then reads `user:FAKE` as a host with a port it cannot parse:
    such a URL is redacted after its scheme."""
    from urllib.parse import urlsplit

    from veca_hf.arguments import redact_urls

    url = f"https://user:FAKE{mark}secret@host/a.tar"
    readable = mark not in "?#/"
    if readable:  # what urllib (and so fsspec, requests) sends as the password
        assert urlsplit(url).password == f"FAKE{mark}secret" and urlsplit(url).hostname == "host"
    shown = "https://<REDACTED>@host/a.tar" if readable else "https://<REDACTED>"
    for text, expected in [
        (url, shown),
        (f"Unable to find '{url}' (503)", f"Unable to find '{shown}' (503)"),
        (f"{url},https://other/b.tar", f"{shown},https://other/b.tar" if readable else None),
    ]:
        redacted = redact_urls(text)
        assert "FAKE" not in redacted and "secret" not in redacted and "user" not in redacted, redacted
        if expected is not None:
            assert redacted == expected
        assert redact_urls(redacted) == redacted  # redacting twice changes nothing


@pytest.mark.parametrize(
    "text, shown",
    [
        (f"https://u:{SECRET}a@h1/a.tar,https://u:{SECRET}b@h2/b.tar",  # a comma that starts a URL separates two
         "https://<REDACTED>@h1/a.tar,https://<REDACTED>@h2/b.tar"),
        (f"https://h1/a.tar?sig={SECRET},s3://b/c.tar", "https://h1/a.tar?<REDACTED>,s3://b/c.tar"),
        (f"https://host/a.tar#token={SECRET}", "https://host/a.tar#<REDACTED>"),
        (f"https://{SECRET}@github.com/org/repo", "https://<REDACTED>@github.com/org/repo"),  # a token as user name
        ("https://host/shard-{a,b}.tar", "https://host/shard-{a,b}.tar"),  # a comma inside a path stays
        (f"reading simplecache::s3://k:{SECRET}@bucket/a.tar failed",
         "reading simplecache::s3://<REDACTED>@bucket/a.tar failed"),
    ],
)  # fmt: skip
def test_url_lists_fragments_and_user_names(text, shown):
    from veca_hf.arguments import redact_urls

    assert redact_urls(text) == shown


def test_an_empty_placeholder_drops_the_credentials():
    from veca_hf.arguments import redact_urls

    url = f"https://u:{SECRET}@host:8080/data/a.parquet?X-Amz-Signature={SECRET}#token={SECRET}"
    assert redact_urls(url, placeholder="") == "https://host:8080/data/a.parquet"


def test_redact_secrets_finds_credentials_by_name_and_in_command_lines():
    from veca_hf.arguments import redact_secrets

    options = json.dumps({"key": SECRET, "client_kwargs": {"endpoint_url": "http://minio:9000"}})
    values = {
        "command": f"python distill.py --hub_token {SECRET} --hub-token={SECRET} --storage_options '{options}' "
        "--seed 0",
        "unquoted": f'python distill.py --storage_options {{"key": "{SECRET}", "secret": "x"}} --seed 0',
        "argv": ["distill.py", "--hub_token", SECRET, f"--access_token={SECRET}", "--storage_options", options,
                 "--seed", "0", "--hub_token"],
        "hub_tokens": [SECRET], "access_tokens": SECRET, "num_core_tokens": 8, "max_new_tokens": 20,
        "credentials": {"user": "me", "pass": SECRET, "nested": {"x": SECRET}},
        "pwd": SECRET, "bearer": SECRET, "sas": SECRET, "jwt": SECRET, "sas_token": SECRET, "password": 424242,
        "url": f"https://host/a.tar#token={SECRET}",
        "message": "Reading 'https://host/a.tar' failed --seed 0",
    }  # fmt: skip
    redacted = redact_secrets(values)
    text = json.dumps(redacted)
    assert SECRET not in text and "424242" not in text
    redacted_options = json.dumps({"key": "<REDACTED>", "client_kwargs": "<REDACTED>"})
    assert redacted["command"] == (
        f"python distill.py --hub_token <HUB_TOKEN> --hub-token=<HUB_TOKEN> --storage_options '{redacted_options}' "
        "--seed 0"
    )
    assert redacted["unquoted"] == "python distill.py --storage_options <REDACTED> --seed 0"
    assert redacted["argv"] == ["distill.py", "--hub_token", "<HUB_TOKEN>", "--access_token=<ACCESS_TOKEN>",
                                "--storage_options", redacted_options, "--seed", "0", "--hub_token"]  # fmt: skip
    assert redacted["num_core_tokens"] == 8 and redacted["max_new_tokens"] == 20  # counts, not credentials
    assert redacted["credentials"] == {"user": "<REDACTED>", "pass": "<REDACTED>", "nested": "<REDACTED>"}
    assert redacted["sas_token"] == "<SAS_TOKEN>" and redacted["hub_tokens"] == "<REDACTED>"
    assert redacted["url"] == "https://host/a.tar#<REDACTED>"
    assert redacted["message"] == values["message"]  # text without credentials stays as it was


def test_benchmark_records_carry_no_credentials():
    spec = importlib.util.spec_from_file_location("benchmark_common", ROOT / "benchmarks" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    command = common.command_line(["--hub_token", SECRET, "--images_dir", f"https://u:{SECRET}@host/photos"])
    assert SECRET not in command and "--hub_token '<HUB_TOKEN>'" in command


# One flag per concept across the scripts: transformers' name where it has one, the other spellings as aliases.
CANONICAL_FLAGS = {
    "image_column_name": ("image_column",),
    "label_column_name": ("label_column",),
    "image_processor_name": ("image_processor_name_or_path",),
    "per_device_eval_batch_size": ("per_device_batch_size", "extraction_batch_size"),
    "train_split": ("split",),
    "dataloader_num_workers": ("num_workers",),
    "activation_checkpointing": ("gradient_checkpointing",),
}
# TrainingArguments keeps this deprecated field of its own (transformers maps it onto activation_checkpointing).
TRANSFORMERS_OWN_ALIASES = {"gradient_checkpointing"}
PACKAGE_SCRIPTS = {
    "convert_veca_original": "veca_hf.hub.convert_veca_original",
    "export_onnx": "veca_hf.hub.export_onnx",
}
SCRIPTS = sorted(path.stem for path in (ROOT / "examples").glob("*.py")) + sorted(PACKAGE_SCRIPTS)


class _Parsed(Exception):
    pass


def script_parser(name: str, monkeypatch):
    """The parser a script (examples/<name>.py, or a package module's `main`) builds, caught as it starts parsing."""
    import argparse
    import sys

    captured = []

    def capture(parser, args=None, namespace=None):
        captured.append(parser)
        raise _Parsed

    module = importlib.import_module(PACKAGE_SCRIPTS[name]) if name in PACKAGE_SCRIPTS else _load_script(name)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    monkeypatch.setattr(sys, "argv", [f"{name}.py"])
    with pytest.raises(_Parsed):
        module.main()
    monkeypatch.undo()
    return captured[0]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_names_each_concept_the_same_way(name, monkeypatch):
    parser = script_parser(name, monkeypatch)
    options = parser._option_string_actions
    help_text = parser.format_help()
    for canonical, aliases in CANONICAL_FLAGS.items():
        for alias in aliases:
            if f"--{alias}" not in options:
                continue
            if alias in TRANSFORMERS_OWN_ALIASES:
                assert f"--{canonical}" in options, (name, alias)
                continue
            # The alias is another spelling of the canonical flag (same field), and --help shows only the canonical.
            assert options[f"--{alias}"].dest == canonical, (name, alias)
            assert options[f"--{alias}"].option_strings[0] == f"--{canonical}", (name, alias)
            assert not re.search(rf"--{alias}\b", help_text), (name, alias)
            assert f"--{canonical}" in help_text, (name, canonical)
    assert "-h, --help" in help_text


def test_the_aliases_parse_to_the_canonical_fields(tmp_path):
    model, data, args = _load_script("distill").parse_args(
        ["--dataset_name", "images", "--image_column", "img", "--gradient_checkpointing", "--teacher_dtype", "bf16"]
    )
    assert (data.image_column_name, args.activation_checkpointing, args.teacher_dtype) == ("img", True, "bfloat16")

    extract = _load_script("extract_features")
    required = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"]
    aliases = ["--split", "validation", "--image_column", "img", "--image_processor_name_or_path", "p",
           "--per_device_batch_size", "3", "--dtype", "bf16"]  # fmt: skip
    (args,) = parse_args_with_file(HfArgumentParser(extract.ExtractionArguments), required + aliases)
    assert (args.train_split, args.image_column_name, args.image_processor_name) == ("validation", "img", "p")
    assert (args.per_device_eval_batch_size, args.dtype) == (3, "bfloat16")

    probe = _load_script("linear_probe")
    parser = HfArgumentParser((probe.ModelArguments, probe.DataArguments, probe.ProbeSettings, probe.OutputArguments))
    aliases = ["--image_column", "i", "--label_column", "l", "--extraction_batch_size", "5", "--num_workers", "2",
           "--dtype", "fp16", "--feature_dtype", "fp16"]  # fmt: skip
    model, data, settings, _ = parse_args_with_file(parser, aliases)
    assert (data.image_column_name, data.label_column_name, model.dtype) == ("i", "l", "float16")
    assert (settings.per_device_eval_batch_size, settings.dataloader_num_workers, settings.feature_dtype) == (
        5,
        2,
        "float16",
    )

    segmentation = _load_script("finetune_segmentation")
    parser = HfArgumentParser((segmentation.ModelArguments, segmentation.DataTrainingArguments))
    _, data = parse_args_with_file(parser, ["--model_name_or_path", "m", "--image_column", "i", "--label_column", "l"])
    assert (data.image_column_name, data.label_column_name) == ("i", "l")

    # An arguments file written with the aliases as keys reads the same.
    path = tmp_path / "args.yaml"
    path.write_text("dataset_name: images\nimage_column: img\ngradient_checkpointing: true\nteacher_dtype: fp32\n")
    _, data, args = _load_script("distill").parse_args([str(path)])
    assert (data.image_column_name, args.activation_checkpointing, args.teacher_dtype) == ("img", True, "float32")


def test_linear_probe_feature_cache_is_its_own_flag(tmp_path):
    probe = _load_script("linear_probe")
    parser = HfArgumentParser((probe.ModelArguments, probe.DataArguments, probe.ProbeSettings, probe.OutputArguments))
    (model, *_) = parse_args_with_file(parser, ["--feature_cache_dir", str(tmp_path)])
    assert model.feature_cache_dir == str(tmp_path)
    # `--cache_dir` is the Hub cache in the fine-tuning scripts: here it is no alias, so it is refused.
    with pytest.raises(ValueError, match="not used by the HfArgumentParser: \\['--cache_dir'"):
        parse_args_with_file(parser, ["--cache_dir", str(tmp_path)])


@pytest.mark.parametrize(
    "flag, value", [("--dtype", "fp8"), ("--teacher_dtype", "int8"), ("--feature_dtype", "bfloat16")]
)
def test_a_dtype_flag_names_the_flag_the_value_and_the_choices(flag, value):
    from veca_hf.arguments import canonical_dtype

    allowed = ("float32", "float16") if flag == "--feature_dtype" else ("float32", "bfloat16")
    with pytest.raises(ValueError, match=rf"{flag} '{value}' is not one of \[.*'float32'.*\]: pass one of them"):
        canonical_dtype(flag, value, allowed)
    assert canonical_dtype(flag, "fp32", allowed) == canonical_dtype(flag, "float32", allowed) == "float32"


def test_distill_enables_activation_checkpointing_by_its_transformers_5_name():
    distill = _load_script("distill")
    calls = []

    class Current:
        def activation_checkpointing_enable(self):
            calls.append("activation")

        def gradient_checkpointing_enable(self):
            calls.append("gradient")

    class TransformersFour:
        def gradient_checkpointing_enable(self):
            calls.append("gradient")

    distill.enable_activation_checkpointing(Current())
    distill.enable_activation_checkpointing(TransformersFour())
    assert calls == ["activation", "gradient"]
