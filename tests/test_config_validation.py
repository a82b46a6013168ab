"""Every bad configuration value is a `ValueError` naming the field and what is allowed, at config time; whatever
values are drawn, a config and a forward either work or raise `ValueError`."""

import dataclasses
import json
import math
from typing import get_args

import pytest
import torch
from conftest import tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from veca_hf import VecaConfig, VecaModel
from veca_hf.training.distillation import build_student_config


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_attention_heads", 0, "num_attention_heads=0 must be a positive integer"),
        ("num_attention_heads", -2, "num_attention_heads=-2 must be a positive integer"),
        ("num_hidden_layers", 0, "num_hidden_layers=0 must be a positive integer"),
        ("num_hidden_layers", -1, "num_hidden_layers=-1 must be a positive integer"),
        ("patch_size", 0, "patch_size=0 must be a positive integer"),
        ("num_channels", 0, "num_channels=0 must be a positive integer"),
        ("hidden_size", 0, "hidden_size=0 must be a positive integer"),
        ("intermediate_size", 0, "intermediate_size=0 must be a positive integer"),
        ("core_chunk_size", 0, "core_chunk_size=0 must be a positive integer"),
        ("layer_norm_eps", -1e-5, "layer_norm_eps=-1e-05 must be positive"),
        ("rope_theta", 0.0, "rope_theta=0.0 must be positive"),
        ("core_coordinate_init_candidates", 0, "core_coordinate_init_candidates=0 must be at least core_bank_size"),
        ("core_coordinate_init_candidates", 15, "core_coordinate_init_candidates=15 must be at least core_bank_size"),
        ("core_coordinate_init_range", 0.0, r"core_coordinate_init_range=0.0 must be in \(0, 1\]"),
        ("pos_embed_rescale", 0.5, "pos_embed_rescale=0.5 must be None"),
        ("pos_embed_jitter", 0.9, "pos_embed_jitter=0.9 must be None"),
        ("pos_embed_shift", -0.1, "pos_embed_shift=-0.1 must be None"),
        ("hidden_act", "swish2", "hidden_act='swish2' is not an activation"),
    ],
)
def test_bad_values_are_value_errors_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{field: value})


def test_student_overrides_typos_and_non_objects_are_errors():
    with pytest.raises(ValueError, match=r"unknown VecaConfig field\(s\) 'num_hiden_layers' \(did you mean "
                                         r"'num_hidden_layers'\?\)"):  # fmt: skip
        build_student_config(None, "veca-s16", '{"num_hiden_layers": 2}')
    with pytest.raises(ValueError, match="must be a JSON object of VecaConfig fields.*got a list"):
        build_student_config(None, "veca-s16", "[2]")
    with pytest.raises(ValueError, match="is not valid JSON"):
        build_student_config(None, "veca-s16", "{num_hidden_layers: 2}")
    assert build_student_config(None, "veca-s16", '{"num_hidden_layers": 2}').num_hidden_layers == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hidden_size=st.integers(-4, 96),
    num_attention_heads=st.integers(-2, 8),
    num_hidden_layers=st.integers(-1, 3),
    intermediate_size=st.integers(-1, 64),
    patch_size=st.integers(-1, 9),
    num_channels=st.integers(-1, 4),
    core_bank_size=st.integers(-8, 24),
    core_chunk_size=st.integers(-1, 9),
    core_coordinate_init_candidates=st.integers(-1, 40),
    layer_norm_eps=st.floats(-1.0, 1.0, allow_nan=False),
    pos_embed_rescale=st.one_of(st.none(), st.floats(0.0, 3.0)),
    side=st.integers(1, 40),
)
def test_any_drawn_config_works_or_is_a_value_error(side, **values):
    try:
        config = VecaConfig(**values)
    except ValueError:
        return
    model = VecaModel(config).eval()
    pixel_values = torch.randn(1, max(config.num_channels, 1), side, side)
    try:
        with torch.no_grad():
            outputs = model(pixel_values)
    except ValueError:
        return
    grid = side // config.patch_size
    assert outputs.last_hidden_state.shape == (1, config.core_bank_size + grid * grid, config.hidden_size)


def test_a_folder_that_names_the_bank_num_core_tokens_still_loads(tmp_path):
    """Folders saved before the bank was `core_bank_size` (their config.json says `num_core_tokens`, also the
    converter's older output) load with the same bank and weights; a config saved today writes the new name only."""
    model = VecaModel(tiny_config(core_bank_size=24)).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["core_bank_size"] == 24 and "num_core_tokens" not in saved
    saved["num_core_tokens"] = saved.pop("core_bank_size")
    (tmp_path / "config.json").write_text(json.dumps(saved))

    reloaded = VecaModel.from_pretrained(tmp_path).eval()
    assert reloaded.config.core_bank_size == 24 and reloaded.config.budgets == [8, 16, 24]
    pixel_values = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(pixel_values).last_hidden_state, model(pixel_values).last_hidden_state)
    assert VecaConfig(num_core_tokens=16, core_coordinate_init_candidates=100).core_bank_size == 16


FLOAT_FIELDS = [field.name for field in dataclasses.fields(VecaConfig) if float in (field.type, *get_args(field.type))]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("hidden_size", "768", "hidden_size='768' has type str, but hidden_size takes int: pass e.g. hidden_size=768"),
        ("num_hidden_layers", 2.0, "num_hidden_layers=2.0 has type float, but num_hidden_layers takes int"),
        ("hidden_size", True, "hidden_size=True has type bool, but hidden_size takes int"),
        ("rope_theta", "100", "rope_theta='100' has type str, but rope_theta takes float: pass e.g. rope_theta=100.0"),
        ("pos_embed_shift", "0.1", r"pos_embed_shift='0.1' has type str, but pos_embed_shift takes float \| None"),
        (
            "default_num_core_tokens",
            8.0,
            r"default_num_core_tokens=8.0 has type float, but .* takes int \| str \| None",
        ),
        ("apply_layernorm", "yes", "apply_layernorm='yes' has type str, but apply_layernorm takes bool"),
    ],
)
def test_values_of_the_wrong_type_are_value_errors_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{field: value})
    config = tiny_config()
    with pytest.raises(ValueError, match=message):  # assignment is checked as well
        setattr(config, field, value)


def test_a_saved_config_with_a_float_size_is_a_value_error():
    saved = tiny_config().to_dict()
    saved["hidden_size"] = 64.0  # e.g. written by a tool that stores every number as a float
    with pytest.raises(ValueError, match="hidden_size=64.0 has type float, but hidden_size takes int"):
        VecaConfig.from_dict(saved)


def test_every_float_field_is_covered():
    assert set(FLOAT_FIELDS) == {
        "layer_norm_eps", "initializer_range", "rope_theta", "rope_zero_frequency_ratio", "pos_embed_shift",
        "pos_embed_jitter", "pos_embed_rescale", "core_coordinate_init_range", "core_coordinate_step_init",
    }  # fmt: skip


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_every_float_field_must_be_finite(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value!r} must be a finite number"):
        tiny_config(**{field: value})


def test_core_coordinate_init_candidates_is_bounded():
    assert tiny_config(core_coordinate_init_candidates=100_000).core_coordinate_init_candidates == 100_000
    with pytest.raises(ValueError, match="core_coordinate_init_candidates=100001 must be at most 100000"):
        tiny_config(core_coordinate_init_candidates=100_001)
