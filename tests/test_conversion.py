"""Reference checkpoints convert to VecaModel and give the reference code's numbers, for every budget."""

import pickle
import subprocess
import sys

import pytest
import torch
from conftest import FIXTURES
from reference_veca import ReferenceVeca
from safetensors.torch import load_file

from veca_hf import VecaImageProcessor, VecaModel
from veca_hf.hub.convert_veca_original import convert_checkpoint, convert_state_dict, infer_config, main


def perturbed_reference(seed: int = 0, **sizes) -> ReferenceVeca:
    """A reference-layout model whose every parameter is random and non-trivial (biases, norms, steps...)."""
    values = dict(hidden_dim=64, num_heads=2, num_layers=3, mlp_hidden=96, num_query_tokens=24)
    values.update(sizes)
    reference = ReferenceVeca(**values).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            scale = 0.5 if "qcoord" in name else 0.3 if "pos_alpha" in name else 0.1
            p.copy_(
                torch.randn(p.shape, generator=generator) * scale + (1.0 if "norm" in name and "weight" in name else 0)
            )
    return reference


def save_reference(reference: ReferenceVeca, path, config: dict | None = None, prefix: str = "module.") -> None:
    state_dict = {prefix + k: v for k, v in reference.state_dict().items()}
    torch.save({"student": state_dict, "config": config or {"num_heads": reference.num_heads}, "step": 7}, path)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_fixture_checkpoint_matches_the_reference_code(tmp_path, attn_implementation):
    convert_checkpoint(FIXTURES / "tiny_reference.pth", tmp_path)
    model = VecaModel.from_pretrained(tmp_path, attn_implementation=attn_implementation).eval()
    vectors = load_file(FIXTURES / "tiny_vectors.safetensors")
    for budget in (8, 16):
        with torch.no_grad():
            outputs = model(vectors["pixel_values"], num_core_tokens=budget)
        torch.testing.assert_close(outputs.pooler_output, vectors[f"global_C{budget}"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            outputs.last_hidden_state[:, budget:], vectors[f"patches_C{budget}"], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("height, width", [(64, 48), (32, 80), (48, 48)])
def test_converted_model_equals_the_dense_masked_reference_for_every_budget(height, width):
    reference = perturbed_reference()
    state_dict = reference.state_dict()
    model = VecaModel(infer_config(state_dict, {"num_heads": 2})).eval()
    model.load_state_dict(convert_state_dict(state_dict, model.config), strict=True)
    pixel_values = torch.randn(2, 3, height, width)
    for budget in (8, 16, 24):
        with torch.no_grad():
            expected_global, expected_patches, expected_tokens = reference(pixel_values, budget)
            outputs = model(pixel_values, num_core_tokens=budget)
        torch.testing.assert_close(outputs.last_hidden_state, expected_tokens, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(outputs.pooler_output, expected_global, atol=2e-5, rtol=1e-5)


@pytest.mark.processes
def test_cli_writes_a_complete_folder(tmp_path):
    output_dir = tmp_path / "converted"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "veca_hf.hub.convert_veca_original",
            "--checkpoint",
            str(FIXTURES / "tiny_reference.pth"),
            "--output_dir",
            str(output_dir),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "D=64, L=2, heads=2, bank=16" in result.stdout
    names = {p.name for p in output_dir.iterdir()}
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "modeling_veca.py"} <= names
    assert VecaImageProcessor.from_pretrained(output_dir).crop_size == {"height": 256, "width": 256}
    model = VecaModel.from_pretrained(output_dir)
    assert model.config.rope_zero_frequency_ratio == 0.125 and model.config.core_bank_size == 16


def test_cli_accepts_the_dashed_spellings_too(tmp_path, capsys):
    from veca_hf.hub.convert_veca_original import main

    main(
        [
            "--checkpoint",
            str(FIXTURES / "tiny_reference.pth"),
            "--output-dir",
            str(tmp_path / "dashed"),
            "--no-latency",
        ]
    )
    assert "bank=16" in capsys.readouterr().out
    assert (tmp_path / "dashed" / "model.safetensors").is_file()


def test_prefixes_and_bare_state_dicts_are_accepted(tmp_path):
    reference = perturbed_reference(num_layers=2)
    pixel_values = torch.randn(1, 3, 32, 32)
    expected = reference(pixel_values, 8)[2]
    for index, (prefix, wrap) in enumerate([("module.student.", True), ("", False)]):
        state_dict = {prefix + k: v for k, v in reference.state_dict().items()}
        path = tmp_path / f"ckpt{index}.pth"
        torch.save({"student": state_dict, "config": {"num_heads": 2}} if wrap else state_dict, path)
        model = convert_checkpoint(path)
        # a bare state dict has no head count: 64-wide heads are assumed -> here 1 head of 64
        if wrap:
            torch.testing.assert_close(
                model(pixel_values, num_core_tokens=8).last_hidden_state, expected, atol=2e-5, rtol=0
            )
        else:
            assert model.config.num_attention_heads == 1


def test_unknown_keys_are_refused(tmp_path):
    reference = perturbed_reference(num_layers=2)
    state_dict = dict(reference.state_dict())
    state_dict["blocks.0.attn.qk_norm.weight"] = torch.ones(64)
    torch.save({"student": state_dict, "config": {"num_heads": 2}}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="qk_norm"):
        convert_checkpoint(tmp_path / "bad.pth")


def test_config_that_disagrees_with_the_tensors_is_refused(tmp_path):
    reference = perturbed_reference(num_layers=2)
    save_reference(reference, tmp_path / "bad.pth", config={"num_heads": 2, "hidden_dim": 128})
    with pytest.raises(ValueError, match="hidden_dim"):
        convert_checkpoint(tmp_path / "bad.pth")


def test_not_a_veca_checkpoint_is_refused(tmp_path):
    torch.save({"student": {"encoder.weight": torch.zeros(2, 2)}}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="Not a VECA reference checkpoint"):
        convert_checkpoint(tmp_path / "other.pth")
    with pytest.raises(ValueError, match="does not exist"):
        convert_checkpoint(tmp_path / "missing.pth")


class _Opaque:  # pickled by reference: not loadable with weights_only=True
    pass


def test_unsafe_pickles_need_explicit_permission(tmp_path):
    reference = perturbed_reference(num_layers=2)
    state_dict = {"module." + k: v for k, v in reference.state_dict().items()}
    path = tmp_path / "pickled.pth"
    torch.save({"student": state_dict, "config": {"num_heads": 2}, "args": _Opaque()}, path, pickle_module=pickle)
    with pytest.raises(ValueError, match="--allow-unsafe-pickle"):
        convert_checkpoint(path)
    model = convert_checkpoint(path, allow_unsafe_pickle=True)
    assert model.config.num_hidden_layers == 2


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    torch.save({"student": {"x": torch.zeros(1)}}, tmp_path / "other.pth")
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(tmp_path / "other.pth"), "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "Not a VECA reference checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_cli_reports_a_truncated_checkpoint_without_a_traceback(tmp_path, capsys, suffix):
    from safetensors.torch import save_file

    path = tmp_path / f"cut{suffix}"
    state = {"weight": torch.randn(64, 64)}
    save_file(state, path) if suffix == ".safetensors" else torch.save(state, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(path), "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "truncated" in error and str(path) in error and "Traceback" not in error
