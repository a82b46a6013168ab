"""ONNX export (`python -m veca_hf.hub.export_onnx`): one budget per file, dynamic batch, height and width; onnxruntime
matches PyTorch. One export of a tiny model (about 10 s on 2 CPU cores) shared by the tests below."""

import pytest
import torch
from conftest import tiny_config

from veca_hf import VecaForImageClassification, VecaImageProcessor, VecaModel


onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from veca_hf.hub.export_onnx import export_onnx, main, verify_onnx, verify_onnx_int8  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny `VecaModel` folder exported at budget 8 by the CLI: `(model, onnx path)`."""
    root = tmp_path_factory.mktemp("onnx")
    torch.manual_seed(0)
    VecaModel(tiny_config()).save_pretrained(root / "tiny")
    VecaImageProcessor().save_pretrained(root / "tiny")
    main(["--model_name_or_path", str(root / "tiny"), "--num_core_tokens", "8", "--output", str(root / "m.onnx")])
    return VecaModel.from_pretrained(root / "tiny").eval(), root / "m.onnx"


@pytest.mark.parametrize("batch_size, height, width", [(2, 64, 96), (1, 128, 64), (3, 32, 32)])
def test_onnxruntime_matches_pytorch_at_several_sizes(exported, batch_size, height, width):
    model, path = exported
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pixel_values = torch.randn(batch_size, 3, height, width, generator=torch.Generator().manual_seed(height))
    last_hidden_state, pooler_output = session.run(None, {"pixel_values": pixel_values.numpy()})
    with torch.no_grad():
        expected = model(pixel_values, num_core_tokens=8)
    num_patches = (height // 16) * (width // 16)
    assert last_hidden_state.shape == (batch_size, 8 + num_patches, 64)
    torch.testing.assert_close(torch.from_numpy(last_hidden_state), expected.last_hidden_state, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.from_numpy(pooler_output), expected.pooler_output, atol=2e-5, rtol=1e-5)


def test_file_records_its_budget_and_dynamic_axes(exported):
    _, path = exported
    proto = onnx.load(str(path), load_external_data=False)
    metadata = {entry.key: entry.value for entry in proto.metadata_props}
    assert metadata["num_core_tokens"] == "8" and metadata["patch_size"] == "16"
    assert [output.name for output in proto.graph.output] == ["last_hidden_state", "pooler_output"]
    (pixel_values,) = proto.graph.input
    dims = pixel_values.type.tensor_type.shape.dim
    assert pixel_values.name == "pixel_values"
    assert [bool(d.dim_param) for d in dims] == [True, False, True, True]  # batch, 3, height, width


def test_verify_onnx_reports_the_difference(exported):
    model, path = exported
    assert verify_onnx(model, path, 8) < 2e-5
    with pytest.raises(ValueError, match="exported at budget 8, not num_core_tokens=16"):
        verify_onnx(model, path, 16)
    with pytest.raises(ValueError, match="differs from PyTorch"):
        verify_onnx(model, path, 8, atol=0.0)


def test_invalid_arguments_fail_before_exporting(tmp_path, capsys):
    model = VecaForImageClassification(tiny_config(num_labels=3)).eval()
    with pytest.raises(ValueError, match="not a valid budget"):
        export_onnx(model, 12, tmp_path / "m.onnx")
    with pytest.raises(ValueError, match="multiples of patch_size"):
        export_onnx(model, 8, tmp_path / "m.onnx", example_size=(40, 32))
    model.save_pretrained(tmp_path / "tiny")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model_name_or_path", str(tmp_path / "tiny"), "--num_core_tokens", "12", "--output", "x.onnx"])
    assert exit_info.value.code == 2 and "--num_core_tokens=12 is not a valid budget" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_int8_export_keeps_the_features_and_the_metadata(tmp_path, capsys):
    """`--int8`: ONNX Runtime's dynamic quantization; every token stays within cosine 0.99 of PyTorch's fp32, no
    temporary file is left, the file says what it holds, and the check refuses a file that drifts further."""
    torch.manual_seed(0)
    VecaModel(tiny_config()).save_pretrained(tmp_path / "tiny")
    output = tmp_path / "m-int8.onnx"
    main(["--model_name_or_path", str(tmp_path / "tiny"), "--num_core_tokens", "8", "--output", str(output),
          "--int8", "--verify"])  # fmt: skip
    assert "-> int8" in capsys.readouterr().out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["m-int8.onnx", "tiny"]
    proto = onnx.load(str(output))
    metadata = {entry.key: entry.value for entry in proto.metadata_props}
    assert metadata["num_core_tokens"] == "8" and metadata["weights"] == "int8"
    assert any(node.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for node in proto.graph.node)
    model = VecaModel.from_pretrained(tmp_path / "tiny").eval()
    sizes = [(2, 64, 96), (1, 128, 64)]
    cosine = verify_onnx_int8(model, output, 8, sizes=sizes)
    assert 0.99 <= cosine < 1 - 1e-7  # int8 rounding: close, never exact
    with pytest.raises(ValueError, match="int8 rounding moves"):
        verify_onnx_int8(model, output, 8, sizes=sizes, min_cosine=1.0)
