"""Inference robustness: any input to the image processors and the model either works or raises a
`ValueError` that names the problem; threads sharing one model get the outputs of one thread; memory stays flat.

Error convention, decided here: a bad *value* raises `ValueError`, including a value of the wrong Python type that
the model reads (a float, str or bool budget, a list as `pixel_values`), as `VecaConfig.check_budget` always did. The
only `TypeError` accepted is transformers' own for processor inputs that are not images at all (`None`, an int);
they never reach VECA code. Anything else (a RuntimeError or IndexError from inside torch, a ZeroDivisionError, an
AssertionError) is a bug, fixed at the input checks (`check_image`, `modeling_utils_veca.check_pixel_values`,
`VecaModel.resolve_num_core_tokens`, `VecaConfig.check_budget`).

Hypothesis runs derandomized and without an example database, so CI sees the same examples on every run.
"""

import concurrent.futures
import gc
import os
import warnings

import numpy as np
import pytest
import torch
from conftest import tiny_config
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from veca_hf import VecaModel
from veca_hf.model import modeling_veca
from veca_hf.model.image_processing_pil_veca import VecaImageProcessorPil


CROP = 16  # processors crop to 16 x 16 (short side 18): tiny outputs even for a 1 x 2000 image
PATCH = 16
BANK = 16  # tiny_config: a bank of 16 cores, budgets 8 and 16
HIDDEN = 64

ROBUST = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def model() -> VecaModel:
    torch.manual_seed(0)
    return VecaModel(tiny_config()).eval()


def _processors():
    processors = {"pil": VecaImageProcessorPil.for_resolution(CROP)}
    try:
        from veca_hf.model.image_processing_veca import VecaImageProcessor

        processors["torchvision"] = VecaImageProcessor.for_resolution(CROP)
    except ImportError:
        pass
    return processors


PROCESSORS = _processors()


# ---------------------------------------------------------------------------------------------------------------------
# Image processors
# ---------------------------------------------------------------------------------------------------------------------

PIL_MODES = ["L", "RGB", "RGBA", "CMYK", "P", "I;16", "F", "LA", "1", "I"]
# Small sides, plus the two extreme strips (resized to 18 x 36000, 2 MB).
SIDES = st.one_of(st.integers(1, 24), st.sampled_from([1, 2000]))
NUMPY_DTYPES = [np.uint8, np.float32, np.float64, np.float16, np.bool_, np.int16, np.int32, np.uint16]
VALUE_RANGES = ["pixels", "unit", "wide", "negative", "nan", "inf"]


@st.composite
def pil_images(draw):
    mode = draw(st.sampled_from(PIL_MODES))
    width, height = draw(SIDES), draw(SIDES)
    if width * height > 4000:  # a strip: one side 1 or small
        width, height = (width, 1) if width > height else (1, height)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return image.convert(mode), {"kind": "pil", "size": (height, width)}


@st.composite
def array_images(draw):
    """NumPy arrays (or torch tensors) HWC / CHW / HW, any of `NUMPY_DTYPES`, 1 to 4 channels, many value ranges."""
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    height, width = draw(SIDES), draw(SIDES)
    if height * width > 4000:
        height, width = (height, 1) if height > width else (1, width)
    channels = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(["hwc", "chw", "hw"]))
    shape = {"hwc": (height, width, channels), "chw": (channels, height, width), "hw": (height, width)}[layout]
    values = draw(st.sampled_from(VALUE_RANGES))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if values == "pixels":
        array = rng.integers(0, 256, shape)
    elif values == "unit":
        array = rng.random(shape)
    elif values == "wide":
        array = rng.uniform(-1e4, 1e4, shape)
    elif values == "negative":
        array = -rng.random(shape)
    else:
        array = rng.random(shape)
        array.flat[rng.integers(array.size)] = np.nan if values == "nan" else -np.inf
    if np.dtype(dtype).kind in "iub" and values in ("nan", "inf"):
        values = "unit"  # integer arrays hold no NaN: cast below
        array = np.nan_to_num(array)
    array = np.clip(array, -32768, 32767) if np.dtype(dtype).kind in "iu" else array
    array = array.astype(dtype)
    as_tensor = draw(st.booleans())
    image = torch.from_numpy(array) if as_tensor else array
    if as_tensor and draw(st.booleans()) and array.dtype.kind == "f":
        image = image.to(torch.bfloat16)  # NumPy has no bfloat16: the PIL backend used to fail on `.numpy()`
    return image, {"kind": "array", "dtype": np.dtype(dtype), "layout": layout, "values": values, "shape": shape}


def _must_work(meta) -> bool:
    """Inputs that every backend has to process (not merely may)."""
    if meta["kind"] == "pil":
        return True
    if meta["dtype"] != np.uint8:
        return False
    # NOTE: HWC with a side of 1, 3 or 4 px reads as CHW (transformers' guess), hence the larger sides here.
    height, width = meta["shape"][:2]
    return meta["layout"] == "hw" or (meta["layout"] == "hwc" and min(height, width) > 4)


def _must_fail(meta) -> str | None:
    """A fragment of the message for inputs that have to raise a `ValueError` (bad in any backend)."""
    if meta["kind"] == "array" and meta["values"] in ("nan", "inf") and meta["dtype"].kind == "f":
        return "NaN or infinite"
    return None


def _process(processor, images):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers warns about ambiguous channels and double rescaling
        return processor(images, return_tensors="pt")["pixel_values"]


def _check_processor_call(processor, images, metas):
    """Either a finite `(n, 3, CROP, CROP)` float32 batch or a `ValueError` with a message."""
    required_failures = [message for message in map(_must_fail, metas) if message]
    try:
        pixel_values = _process(processor, images)
    except ValueError as error:
        event("refused")
        assert str(error), "a ValueError without a message"
        assert not all(map(_must_work, metas)), f"{processor.backend} refused a valid input: {error}"
        if required_failures:
            assert any(message in str(error) for message in required_failures) or "range" in str(error), error
        return
    event("processed")
    assert not required_failures, f"{processor.backend} accepted an invalid input ({required_failures})"
    assert pixel_values.shape == (len(metas), 3, CROP, CROP)
    assert pixel_values.dtype == torch.float32
    assert torch.isfinite(pixel_values).all()


@pytest.mark.parametrize("backend", sorted(PROCESSORS))
@ROBUST
@given(data=st.data())
def test_processor_single_images_work_or_raise_value_error(backend, data):
    image, meta = data.draw(st.one_of(pil_images(), array_images()))
    _check_processor_call(PROCESSORS[backend], image, [meta])


@pytest.mark.parametrize("backend", sorted(PROCESSORS))
@settings(ROBUST, max_examples=40)
@given(items=st.lists(st.one_of(pil_images(), array_images()), min_size=1, max_size=3))
def test_processor_lists_of_mixed_images_work_or_raise_value_error(backend, items):
    images, metas = [image for image, _ in items], [meta for _, meta in items]
    _check_processor_call(PROCESSORS[backend], images, metas)


@pytest.mark.parametrize("backend", sorted(PROCESSORS))
def test_processor_rejects_what_is_not_an_image(backend):
    processor = PROCESSORS[backend]
    for images, message in [
        ([], "empty list"),
        (np.zeros((0, 5, 3), np.uint8), r"empty image of shape \(0, 5, 3\)"),
        (Image.new("RGB", (0, 7)), "empty image of 0x7"),
        (np.zeros((8, 8, 2), np.uint8), r"shape \(8, 8, 2\)"),
        (torch.zeros(3, 8, 8, dtype=torch.complex64), "complex64"),
        (np.full((8, 8, 3), np.nan, np.float32), "NaN or infinite"),
        ([np.zeros((8, 8, 3), np.uint8), np.full((9, 9, 3), np.inf)], "NaN or infinite"),
    ]:
        with pytest.raises(ValueError, match=message):
            _process(processor, images)
    for not_an_image in (None, 3):  # transformers' own TypeError, raised before any VECA code runs
        with pytest.raises(TypeError, match="type="):
            _process(processor, not_an_image)


def test_torchvision_processor_rgba_of_wide_integers_raises_value_error():
    if "torchvision" not in PROCESSORS:
        pytest.skip("torchvision is not installed")
    # It used to fail inside torchvision's `to_dtype` (float32 -> int32 "cannot be performed safely").
    with pytest.raises(ValueError, match="4-channel.*int32"):
        _process(PROCESSORS["torchvision"], np.zeros((8, 8, 4), np.int32))
    # uint8 RGBA is blended on white as before.
    assert _process(PROCESSORS["torchvision"], np.zeros((8, 8, 4), np.uint8)).shape == (1, 3, CROP, CROP)


def test_processor_bfloat16_tensor_equals_float32():
    image = torch.rand(3, 20, 24)
    for backend, processor in PROCESSORS.items():
        from_bfloat16 = _process(processor, image.bfloat16())
        from_float32 = _process(processor, image.bfloat16().float())
        torch.testing.assert_close(from_bfloat16, from_float32, rtol=0, atol=0, msg=backend)


# ---------------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------------

MODEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool]
MODEL_SIDES = [0, 1, 15, 16, 17, 32, 48]


@st.composite
def pixel_value_tensors(draw):
    # NOTE: two draws in three are well-formed, so that enough examples reach the forward pass.
    if draw(st.sampled_from([True, True, False])):
        ndim, batch, channels = 4, draw(st.integers(1, 3)), 3
        height, width = draw(st.sampled_from([16, 32, 48])), draw(st.sampled_from([16, 32, 48]))
    else:
        ndim, batch, channels = draw(st.integers(2, 5)), draw(st.integers(0, 3)), draw(st.integers(1, 4))
        height, width = draw(st.sampled_from(MODEL_SIDES)), draw(st.sampled_from(MODEL_SIDES))
    shape = {2: (height, width), 3: (channels, height, width), 4: (batch, channels, height, width)}.get(
        ndim, (batch, 1, channels, height, width)
    )
    dtype = draw(st.sampled_from(MODEL_DTYPES))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    pixel_values = torch.randn(shape, generator=generator)
    nan = dtype.is_floating_point and pixel_values.numel() > 0 and draw(st.booleans())
    if nan:
        pixel_values.view(-1)[0] = float("nan")  # the first image only
    pixel_values = (pixel_values * 100).clamp(0, 255).to(dtype) if not dtype.is_floating_point else pixel_values
    valid = ndim == 4 and batch > 0 and channels == 3 and height in (16, 32, 48) and width in (16, 32, 48)
    valid = valid and dtype.is_floating_point  # raw (integer) pixels have to go through the image processor
    return pixel_values.to(dtype), {"valid": valid, "nan": nan}


ANY_BUDGET = st.one_of(
    st.integers(-24, 40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([8.0, 16.0, 8.5]),
    st.booleans(),
    st.sampled_from(["8", [8], (16,), np.int32(16), np.float32(8)]),
    st.builds(
        torch.tensor,
        st.one_of(st.integers(-8, 24), st.lists(st.integers(0, 16), max_size=2), st.floats(0, 16), st.booleans()),
    ),
)
# NOTE: two draws in three pick a valid budget, so that enough examples reach the forward pass.
BUDGETS = st.sampled_from([True, True, False]).flatmap(
    lambda valid: st.sampled_from([None, 8, 16, np.int64(8), torch.tensor(16)]) if valid else ANY_BUDGET
)


def _budget_or_none(budget, batch_size: int) -> int | None:
    """The number of active cores a budget means (the largest, for one budget per image), or None if it has to be
    refused. A sequence of one budget serves the whole batch."""
    if budget is None:
        return BANK
    if isinstance(budget, torch.Tensor):
        if budget.dtype.is_floating_point or budget.dtype == torch.bool or budget.ndim > 1:
            return None
        budget = budget.tolist() if budget.ndim == 1 else int(budget)
    if isinstance(budget, (list, tuple)):
        if len(budget) not in (1, batch_size):
            return None
        budgets = [_budget_or_none(value, 1) if not isinstance(value, (list, tuple)) else None for value in budget]
        return None if None in budgets else max(budgets)
    if isinstance(budget, (int, np.integer)) and not isinstance(budget, bool):
        return int(budget) if int(budget) in (8, 16) else None
    return None


@ROBUST
@given(data=pixel_value_tensors(), budget=BUDGETS)
def test_model_works_or_raises_value_error(model, data, budget):
    pixel_values, meta = data
    num_cores = _budget_or_none(budget, pixel_values.shape[0])
    event("valid" if meta["valid"] and num_cores is not None else "refused")
    if not meta["valid"] or num_cores is None:
        with pytest.raises(ValueError) as error:
            with torch.no_grad():
                model(pixel_values, num_core_tokens=budget)
        # the message names the offending input
        names = ("num_core_tokens",) if meta["valid"] else ("pixel_values", "Image size", "channels")
        assert any(name in str(error.value) for name in names), str(error.value)
        return
    with torch.no_grad():
        outputs = model(pixel_values, num_core_tokens=budget)
    batch, _, height, width = pixel_values.shape
    num_tokens = num_cores + (height // PATCH) * (width // PATCH)
    assert outputs.last_hidden_state.shape == (batch, num_tokens, HIDDEN)
    assert outputs.last_hidden_state.dtype == torch.float32
    assert outputs.pooler_output.shape == (batch, HIDDEN)
    assert outputs.core_positions.shape == (batch, num_cores, 2)
    if not meta["nan"]:
        assert torch.isfinite(outputs.last_hidden_state).all()
    elif batch > 1:  # a NaN in image 0 stays in image 0: images never mix
        assert torch.isfinite(outputs.last_hidden_state[1:]).all()


def test_model_rejects_empty_batches_complex_values_and_float_budget_tensors(model):
    with pytest.raises(ValueError, match=r"\(0, 3, 32, 32\) holds no images"):
        model(torch.zeros(0, 3, 32, 32))  # used to fail in the patch embedding's reshape
    with pytest.raises(ValueError, match="complex64"):
        model(torch.zeros(1, 3, 32, 32, dtype=torch.complex64))  # used to drop the imaginary part with a warning
    pixel_values = torch.randn(1, 3, 32, 32)
    for budget in (torch.tensor(8.5), torch.tensor(8.0), torch.tensor(True)):
        with pytest.raises(ValueError, match=r"num_core_tokens=tensor\("):  # 8.5 used to run with 8 cores
            model(pixel_values, num_core_tokens=budget)
    with torch.no_grad():
        expected = model(pixel_values, num_core_tokens=8).last_hidden_state
        for budget in (np.int64(8), torch.tensor(8), torch.tensor([8], dtype=torch.int32)):
            assert torch.equal(model(pixel_values, num_core_tokens=budget).last_hidden_state, expected)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.int32, torch.bool])
def test_model_rejects_pixels_that_were_not_normalised(model, dtype):
    # raw 0-255 pixels used to run through the model unnormalised, with meaningless outputs and no error
    pixel_values = torch.randint(0, 256, (1, 3, 32, 32)).to(dtype)
    with pytest.raises(ValueError, match=rf"pixel_values has dtype {dtype}.*use the image processor"):
        model(pixel_values)


# ---------------------------------------------------------------------------------------------------------------------
# Threads: one model, many callers (a pipeline in a web server)
# ---------------------------------------------------------------------------------------------------------------------

THREAD_JOBS = [((16 * (1 + i % 3), 16 * (1 + i % 4)), (8, 16, None)[i % 3], 1 + i % 2, i) for i in range(24)]


def _run_job(model, job):
    (height, width), budget, batch, seed = job
    pixel_values = torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        outputs = model(pixel_values, num_core_tokens=budget, output_core_positions=True)
    return outputs.last_hidden_state, outputs.all_core_positions


def test_threads_get_the_outputs_of_one_thread(model):
    # NOTE: bitwise equality (torch.equal): every call has the same shapes and the same kernels in either case, and
    # CPU GEMMs of one shape are deterministic. A difference means shared state, not rounding.
    expected = [_run_job(model, job) for job in THREAD_JOBS]
    jobs = THREAD_JOBS * 3
    threads = torch.get_num_threads()  # OpenMP's count is per thread: each pool thread takes the main thread's

    def run_in_pool(job):
        torch.set_num_threads(threads)
        return _run_job(model, job)

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(run_in_pool, jobs))
    for index, (hidden, coordinates) in enumerate(results):
        want_hidden, want_coordinates = expected[index % len(THREAD_JOBS)]
        assert torch.equal(hidden, want_hidden), f"job {jobs[index]}"
        assert all(torch.equal(a, b) for a, b in zip(coordinates, want_coordinates, strict=True)), f"job {jobs[index]}"


def test_threads_inside_cpu_inference_buffers(model, monkeypatch):
    from veca_hf.cpu import buffers

    # All outputs count as large, so every projection takes the shared-buffer path. With one set of buffers for all
    # threads, 63 of 64 outputs of this test were wrong (threads overwrote each other's qkv between two blocks).
    monkeypatch.setattr(buffers, "FRESH_MMAP_BYTES", 0)
    expected = [_run_job(model, job) for job in THREAD_JOBS]
    with buffers.cpu_inference_buffers(model):
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda job: _run_job(model, job), THREAD_JOBS * 2))
    for index, (hidden, _) in enumerate(results):
        torch.testing.assert_close(hidden, expected[index % len(THREAD_JOBS)][0], rtol=1e-5, atol=1e-6)


def test_threads_through_the_feature_extraction_pipeline(model):
    from transformers import pipeline

    extractor = pipeline("image-feature-extraction", model=model, image_processor=PROCESSORS["pil"], device="cpu")
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (8 + 5 * i, 40 - 3 * i, 3), dtype=np.uint8)) for i in range(8)]
    expected = [extractor(image, return_tensors=True) for image in images]
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda image: extractor(image, return_tensors=True), images * 3))
    for index, features in enumerate(results):
        assert features.shape == (1, BANK + (CROP // PATCH) ** 2, HIDDEN)
        assert torch.equal(features, expected[index % len(images)])


# ---------------------------------------------------------------------------------------------------------------------
# Memory: flat over 1,000 calls with changing sizes and budgets
# ---------------------------------------------------------------------------------------------------------------------

RSS_GROWTH_BOUND = 20 * 2**20  # bytes, after a warm-up of 100 calls


def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _lru_cache_of(function):
    """The `functools.lru_cache` that `compile_compatible_method_lru_cache` hides in its wrapper's closure."""
    cells = [cell.cell_contents for cell in function.__closure__ or ()]
    return next(cell for cell in cells if hasattr(cell, "cache_info"))


@pytest.fixture
def one_intra_op_thread():
    """NOTE: on a busy 2-core runner, OpenMP's spinning threads made each tiny call ~10x slower (30 ms instead of
    3 ms); memory, not speed, is what the test measures."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_memory_stays_flat_over_1000_calls(model, one_intra_op_thread):
    rng = np.random.default_rng(0)
    processor = PROCESSORS["pil"]
    cache = _lru_cache_of(modeling_veca.get_patch_coordinates)

    def call(index):
        rows, cols = rng.integers(1, 9, size=2)  # 64 image sizes, more than the cache's 32 entries
        pixel_values = torch.randn(int(rng.integers(1, 3)), 3, 16 * int(rows), 16 * int(cols))
        budget = (8, 16, None)[index % 3]
        with torch.no_grad():
            outputs = model(pixel_values, num_core_tokens=budget)
        assert outputs.last_hidden_state.shape[1] == (budget or BANK) + rows * cols
        if index % 4 == 0:  # the processor too, on images of changing sizes
            image = rng.integers(0, 256, (int(rng.integers(8, 64)), int(rng.integers(8, 64)), 3), dtype=np.uint8)
            assert _process(processor, image).shape == (1, 3, CROP, CROP)

    for index in range(100):
        call(index)
    gc.collect()
    before = _rss()
    for index in range(100, 1000):
        call(index)
    gc.collect()
    growth = _rss() - before
    assert growth < RSS_GROWTH_BOUND, f"RSS grew by {growth / 2**20:.1f} MiB over 900 calls"
    info = cache.cache_info()
    assert info.maxsize == 32 and info.currsize <= 32
