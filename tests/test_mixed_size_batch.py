"""Images of different sizes in one batch: padded to one grid, padded patches masked out of the cores' call.

Patches never attend to each other, so a padded batch is exact: each image's cores and patches equal those of a
forward of that image alone (up to float rounding), at every budget, with eager and SDPA attention.
"""

import numpy as np
import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from veca_hf import VecaBackbone, VecaForImageClassification, VecaModel
from veca_hf.model.image_processing_pil_veca import VecaImageProcessorPil
from veca_hf.model.modeling_veca import get_padded_patch_coordinates, get_patch_coordinates


PATCH = 16
BUDGETS = (8, 16)  # every budget of the tiny config (bank 16, chunk 8)
ATOL = 1e-5


def processor_classes():
    classes = [VecaImageProcessorPil]
    try:
        import torchvision  # noqa: F401

        from veca_hf import VecaImageProcessor

        classes.append(VecaImageProcessor)
    except ImportError:
        pass
    return classes


def smooth_photo(height: int, width: int, seed: int) -> Image.Image:
    """A deterministic photo-like RGB image: a few smooth colour waves and a soft blob."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    channels = []
    for _ in range(3):
        fy, fx, phase = rng.uniform(1, 4), rng.uniform(1, 4), rng.uniform(0, 2 * np.pi)
        cy, cx = rng.uniform(0.2, 0.8, 2)
        blob = np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / 0.05)
        channels.append(0.5 + 0.3 * np.sin(2 * np.pi * (fy * y + fx * x) + phase) + 0.2 * blob)
    return Image.fromarray((np.clip(np.stack(channels, -1), 0, 1) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def photos() -> list[Image.Image]:
    """Photos of different sizes and aspect ratios: scikit-image's bundled real photos when it is installed (the
    [demo] extra), else generated ones of the same sizes. Landscape 3:2, square, and portrait."""
    try:
        from skimage import data

        chelsea, coffee, astronaut = data.chelsea(), data.coffee(), data.astronaut()
        arrays = [chelsea, coffee, astronaut, astronaut[:, 100:400], data.rocket()]
        return [Image.fromarray(array) for array in arrays]
    except ImportError:
        sizes = [(300, 451), (400, 600), (512, 512), (512, 300), (427, 640)]
        return [smooth_photo(height, width, seed) for seed, (height, width) in enumerate(sizes)]


def tiny_model(attn_implementation: str = "sdpa") -> VecaModel:
    model = VecaModel(tiny_config()).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def padded_batch(images: list[torch.Tensor], offsets=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(3, h, w)` images into one zero-padded `(B, 3, H, W)` batch and its `(B, H, W)` pixel mask."""
    height = max(image.shape[1] for image in images) + (max(o[0] for o in offsets) if offsets else 0)
    width = max(image.shape[2] for image in images) + (max(o[1] for o in offsets) if offsets else 0)
    pixel_values = torch.zeros(len(images), 3, height, width)
    pixel_mask = torch.zeros(len(images), height, width, dtype=torch.long)
    for index, image in enumerate(images):
        top, left = offsets[index] if offsets else (0, 0)
        pixel_values[index, :, top : top + image.shape[1], left : left + image.shape[2]] = image
        pixel_mask[index, top : top + image.shape[1], left : left + image.shape[2]] = 1
    return pixel_values, pixel_mask


def max_diff_to_single_forward(model, pixel_values, pixel_mask, images, budget) -> float:
    """The largest difference, over images, cores and real patches, between the padded batch and single forwards."""
    with torch.no_grad():
        batch = model(pixel_values, num_core_tokens=budget, pixel_mask=pixel_mask)
        worst = 0.0
        for index, image in enumerate(images):
            single = model(image[None], num_core_tokens=budget)
            tokens, reference = batch.last_hidden_state[index], single.last_hidden_state[0]
            patches = tokens[budget:][batch.patch_mask[index]]  # the image's own grid, row-major
            assert patches.shape == reference[budget:].shape
            worst = max(
                worst,
                (tokens[:budget] - reference[:budget]).abs().max().item(),
                (patches - reference[budget:]).abs().max().item(),
                (batch.core_positions[index] - single.core_positions[0]).abs().max().item(),
            )
        assert torch.isfinite(batch.last_hidden_state).all()
    return worst


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_padded_batch_equals_single_image_forwards_on_photos(photos, attn_implementation, budget):
    model = tiny_model(attn_implementation)
    processor = VecaImageProcessorPil.for_any_size(64, patch_size=PATCH)
    inputs = processor(photos, return_tensors="pt")
    images = [processor(photo, return_tensors="pt")["pixel_values"][0] for photo in photos]
    assert len({image.shape for image in images}) >= 3  # landscape, square and portrait grids
    assert max_diff_to_single_forward(model, inputs["pixel_values"], inputs["pixel_mask"], images, budget) < ATOL


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_padding_on_any_side_is_exact(attn_implementation):
    """The real region may sit anywhere (here: padded on every side); its patches keep their own grid's positions."""
    model = tiny_model(attn_implementation)
    images = [torch.randn(3, 32, 80), torch.randn(3, 64, 32), torch.randn(3, 48, 48)]
    pixel_values, pixel_mask = padded_batch(images, offsets=[(16, 0), (0, 32), (16, 16)])
    assert max_diff_to_single_forward(model, pixel_values, pixel_mask, images, budget=16) < ATOL


def test_attention_maps_and_hidden_states_under_padding():
    """`output_attentions=True` gives the same tokens, no weight on padded patches, and finite hidden states."""
    model = tiny_model("eager")
    pixel_values, pixel_mask = padded_batch([torch.randn(3, 32, 64), torch.randn(3, 64, 32)])
    with torch.no_grad():
        plain = model(pixel_values, num_core_tokens=8, pixel_mask=pixel_mask)
        maps = model(
            pixel_values, num_core_tokens=8, pixel_mask=pixel_mask, output_attentions=True, output_hidden_states=True
        )
    torch.testing.assert_close(maps.last_hidden_state, plain.last_hidden_state, atol=ATOL, rtol=0)
    padded_keys = ~maps.patch_mask[:, None, None]  # (B, 1, 1, N)
    assert padded_keys.any()
    for attention in maps.attentions:  # (B, H, T, T); no query gives a padded patch any weight
        assert (attention[:, :, :, 8:].masked_select(padded_keys) == 0).all()
    assert all(torch.isfinite(hidden).all() for hidden in maps.hidden_states)


def test_unpadded_pixel_mask_is_the_plain_forward(pixel_values):
    """All-ones `pixel_mask` takes the unmasked path: bit-identical outputs; without it, no `patch_mask`."""
    model = tiny_model()
    with torch.no_grad():
        plain = model(pixel_values)
        masked = model(pixel_values, pixel_mask=torch.ones(2, 64, 48, dtype=torch.long))
    assert torch.equal(plain.last_hidden_state, masked.last_hidden_state)
    assert plain.patch_mask is None and masked.patch_mask.shape == (2, 12) and masked.patch_mask.all()
    assert len(model(pixel_values, return_dict=False)) == 3  # tuples keep their length without a pixel_mask


def test_classification_logits_are_exact_per_image():
    model = VecaForImageClassification(tiny_config(num_labels=5)).eval()
    images = [torch.randn(3, 32, 96), torch.randn(3, 80, 48)]
    pixel_values, pixel_mask = padded_batch(images)
    with torch.no_grad():
        batch = model(pixel_values, pixel_mask=pixel_mask).logits
        single = torch.cat([model(image[None]).logits for image in images])
    torch.testing.assert_close(batch, single, atol=ATOL, rtol=0)


@pytest.mark.parametrize("reshape_hidden_states", [True, False])
def test_backbone_maps_are_exact_per_image(reshape_hidden_states):
    """`VecaBackbone` with `pixel_mask`: each image's region of every stage's map equals its own maps."""
    config = tiny_config(out_features=["stem", "stage1", "stage2"], reshape_hidden_states=reshape_hidden_states)
    backbone = VecaBackbone(config).eval()
    images = [torch.randn(3, 32, 96), torch.randn(3, 80, 48)]
    pixel_values, pixel_mask = padded_batch(images)
    with torch.no_grad():
        batch = backbone(pixel_values, pixel_mask=pixel_mask).feature_maps
        for index, image in enumerate(images):
            rows, cols = image.shape[1] // PATCH, image.shape[2] // PATCH
            for batch_map, single_map in zip(batch, backbone(image[None]).feature_maps, strict=True):
                if reshape_hidden_states:  # (B, D, Hp, Wp): the image's top-left region
                    region = batch_map[index, :, :rows, :cols]
                else:  # (B, 1 + N, D): the global core, then the image's own patches of the padded grid
                    grid = batch_map[index, 1:].reshape(pixel_values.shape[2] // PATCH, -1, batch_map.shape[-1])
                    region = torch.cat([batch_map[index, :1], grid[:rows, :cols].flatten(0, 1)])
                torch.testing.assert_close(region, single_map[0], atol=ATOL, rtol=0)


def test_padded_batch_trains():
    """Train mode (coordinate augmentation on) with padding: finite loss and gradients."""
    model = VecaModel(tiny_config(pos_embed_shift=0.1, pos_embed_jitter=1.1, pos_embed_rescale=1.5)).train()
    pixel_values, pixel_mask = padded_batch([torch.randn(3, 32, 64), torch.randn(3, 64, 32)])
    output = model(pixel_values, num_core_tokens=16, pixel_mask=pixel_mask)
    projection = torch.randn(output.last_hidden_state.shape[-1])
    (output.last_hidden_state @ projection).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(grad).all() for grad in grads)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=4),
    data=st.data(),
)
def test_padded_patch_coordinates_are_each_images_own(sizes, data):
    """Bit-identical to `get_patch_coordinates` of each image's own grid, wherever the image sits."""
    rows, cols = 7, 7
    patch_mask = torch.zeros(len(sizes), rows, cols, dtype=torch.bool)
    boxes = []
    for index, (height, width) in enumerate(sizes):
        top, left = data.draw(st.integers(0, rows - height)), data.draw(st.integers(0, cols - width))
        patch_mask[index, top : top + height, left : left + width] = True
        boxes.append((top, left, height, width))
    coordinates = get_padded_patch_coordinates(patch_mask, torch.float32).view(len(sizes), rows, cols, 2)
    for index, (top, left, height, width) in enumerate(boxes):
        own = get_patch_coordinates(height, width, torch.float32, torch.device("cpu")).view(height, width, 2)
        assert torch.equal(coordinates[index, top : top + height, left : left + width], own)


@pytest.mark.parametrize(
    "make_mask, message",
    [
        (lambda mask: mask[:, :, :40], "shape"),  # not the pixel_values' size
        (lambda mask: mask.index_fill(2, torch.arange(40, 48), 0), "inside a patch"),  # 8 px of padding
        (lambda mask: mask.index_fill(1, torch.arange(16, 32), 0), "rectangle"),  # a padded band in the middle
        (lambda mask: torch.zeros_like(mask), "empty"),
    ],
)
def test_invalid_pixel_masks_raise(pixel_values, make_mask, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        model(pixel_values, pixel_mask=make_mask(torch.ones(2, 64, 48, dtype=torch.long)))


@pytest.mark.parametrize("processor_class", processor_classes())
def test_processor_pads_and_returns_the_pixel_mask(photos, processor_class):
    processor = processor_class.for_any_size(64, patch_size=PATCH)
    inputs = processor(photos, return_tensors="pt")
    pixel_values, pixel_mask = inputs["pixel_values"], inputs["pixel_mask"]
    assert pixel_mask.dtype == torch.int64 and pixel_mask.shape == (len(photos), *pixel_values.shape[-2:])
    for index, photo in enumerate(photos):
        own = processor(photo, return_tensors="pt")
        _, _, height, width = own["pixel_values"].shape
        assert height % PATCH == 0 and width % PATCH == 0 and min(height, width) == 64
        assert abs(width / height - photo.width / photo.height) < PATCH / 64  # aspect kept up to rounding
        assert own["pixel_mask"].all()  # one image: nothing to pad
        assert pixel_mask[index, :height, :width].all() and pixel_mask[index].sum() == height * width
        torch.testing.assert_close(pixel_values[index, :, :height, :width], own["pixel_values"][0])
        assert (pixel_values[index][:, pixel_mask[index] == 0] == 0).all()
    assert pixel_values.shape[-2:] == (
        max(m.any(1).sum() for m in pixel_mask),
        max(m.any(0).sum() for m in pixel_mask),
    )


@pytest.mark.parametrize("processor_class", processor_classes())
def test_processor_size_options_and_defaults(photos, processor_class, tmp_path):
    bounded = processor_class.for_any_size(64, size={"shortest_edge": 64, "longest_edge": 80}, pad_size=80)
    inputs = bounded(photos, return_tensors="pt")
    assert inputs["pixel_values"].shape[-2:] == (80, 80)
    assert all(m.any(1).sum() <= 80 and m.any(0).sum() <= 80 for m in inputs["pixel_mask"])
    longest = processor_class(size={"longest_edge": 96}, do_center_crop=False, ensure_multiple_of=PATCH)
    assert [tuple(x.shape[-2:]) for x in longest(photos[:3])["pixel_values"]] == [(64, 96), (64, 96), (96, 96)]
    # Defaults unchanged: shortest edge 288, centre crop 256, no padding, no pixel_mask.
    default = processor_class()(photos, return_tensors="pt")
    assert set(default) == {"pixel_values"} and default["pixel_values"].shape == (len(photos), 3, 256, 256)
    # The settings round-trip through save_pretrained / from_pretrained.
    processor = processor_class.for_any_size(64)
    processor.save_pretrained(tmp_path)
    loaded = processor_class.from_pretrained(tmp_path)
    assert (loaded.ensure_multiple_of, loaded.do_pad, loaded.do_center_crop) == (PATCH, True, False)
    with pytest.raises(ValueError, match="ensure_multiple_of"):
        processor_class(ensure_multiple_of=0, do_center_crop=False)(photos[0])


def test_backends_agree_on_sizes_and_masks(photos):
    classes = processor_classes()
    if len(classes) < 2:
        pytest.skip("needs torchvision")
    pil, torchvision_backend = (cls.for_any_size(64)(photos, return_tensors="pt") for cls in classes)
    assert torch.equal(pil["pixel_mask"], torchvision_backend["pixel_mask"])
    torch.testing.assert_close(pil["pixel_values"], torchvision_backend["pixel_values"], atol=0.04, rtol=0)


def test_feature_extraction_pipeline_batches_mixed_sizes(photos, tmp_path):
    """Pipelines preprocess image by image and then stack: a fixed `pad_size` makes the stack work, and each
    image's global feature equals its single-image one."""
    from transformers import pipeline

    model = tiny_model()
    model.save_pretrained(tmp_path)
    processor = VecaImageProcessorPil.for_any_size(
        64, size={"shortest_edge": 64, "longest_edge": 112}, pad_size={"height": 112, "width": 112}
    )
    extractor = pipeline("image-feature-extraction", model=str(tmp_path), image_processor=processor)
    pooled = extractor(photos, batch_size=len(photos), pool=True, return_tensors=True)
    tokens = extractor(photos, batch_size=2, return_tensors=True)
    assert [t.shape for t in tokens] == [(1, 16 + 49, 64)] * len(photos)  # default budget 16, padded 7 x 7 grid
    single = VecaImageProcessorPil.for_any_size(64, size={"shortest_edge": 64, "longest_edge": 112})
    with torch.no_grad():
        expected = [model(**single(photo, return_tensors="pt")).pooler_output for photo in photos]
    for got, want in zip(pooled, expected, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
