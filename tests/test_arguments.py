"""Argument files for the example scripts (`veca_hf.arguments.parse_args_with_file`): one loader for all of them."""

import importlib.util
import json
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

    from veca_hf.training.trainer import parse_finetuning_args

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
