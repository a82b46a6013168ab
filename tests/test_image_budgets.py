"""A budget per image in one batch: `num_core_tokens` a list of one budget per image.

Every image's outputs equal those of a forward of that image alone at its budget (fp32, 1e-5), whether the batch runs
as one sub-batch per budget (`config.group_image_budgets=True`) or as one call at the largest budget with the unused
cores masked out of every attention (`False`), with eager and SDPA attention, for images of one size and of several
(`pixel_mask`), in `VecaModel`, `VecaForImageClassification`, `VecaBackbone` and the dense heads.
"""

import numpy as np
import pytest
import torch
from conftest import tiny_config

from veca_hf import (
    VecaBackbone,
    VecaForDepthEstimation,
    VecaForImageClassification,
    VecaForSemanticSegmentation,
    VecaModel,
)


ATOL = 1e-5
BANK = 24  # budgets 8, 16 and 24
BUDGETS = [8, 24, 16, 8, 24]


def tiny(model_class=VecaModel, *, group: bool, attn_implementation: str = "sdpa", **overrides):
    torch.manual_seed(0)
    config = tiny_config(core_bank_size=BANK, num_hidden_layers=3, group_image_budgets=group, **overrides)
    model = model_class(config).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def images(batch_size: int = len(BUDGETS), height: int = 48, width: int = 64) -> torch.Tensor:
    return torch.randn(batch_size, 3, height, width, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("group", [True, False], ids=["grouped", "masked"])
def test_each_image_equals_its_own_forward_at_its_budget(group, attn_implementation):
    model = tiny(group=group, attn_implementation=attn_implementation)
    pixel_values = images()
    with torch.no_grad():
        outputs = model(pixel_values, num_core_tokens=BUDGETS, output_core_positions=True)
        largest = max(BUDGETS)
        assert outputs.last_hidden_state.shape == (len(BUDGETS), largest + 12, 64)
        assert outputs.core_mask.tolist() == [[core < budget for core in range(largest)] for budget in BUDGETS]
        for index, budget in enumerate(BUDGETS):
            alone = model(pixel_values[index : index + 1], num_core_tokens=budget, output_core_positions=True)
            torch.testing.assert_close(outputs.pooler_output[index], alone.pooler_output[0], atol=ATOL, rtol=0)
            torch.testing.assert_close(
                outputs.last_hidden_state[index, :budget], alone.last_hidden_state[0, :budget], atol=ATOL, rtol=0
            )
            torch.testing.assert_close(
                outputs.last_hidden_state[index, largest:], alone.last_hidden_state[0, budget:], atol=ATOL, rtol=0
            )
            torch.testing.assert_close(
                outputs.core_positions[index, :budget], alone.core_positions[0], atol=ATOL, rtol=0
            )
            torch.testing.assert_close(
                outputs.all_core_positions[-1][index, :budget], alone.all_core_positions[-1][0], atol=ATOL, rtol=0
            )
            # the cores an image does not use read zero
            assert not outputs.last_hidden_state[index, budget:largest].any()
            assert not outputs.core_positions[index, budget:].any()


@pytest.mark.parametrize("group", [True, False], ids=["grouped", "masked"])
def test_images_of_different_sizes_and_budgets_in_one_batch(group):
    model = tiny(group=group)
    sizes = [(48, 64), (64, 32), (32, 32), (64, 64)]
    budgets = [16, 8, 24, 8]
    pixel_values = torch.zeros(len(sizes), 3, 64, 64)
    pixel_mask = torch.zeros(len(sizes), 64, 64, dtype=torch.long)
    singles = []
    for index, (height, width) in enumerate(sizes):
        single = torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(index))
        pixel_values[index, :, :height, :width] = single[0]
        pixel_mask[index, :height, :width] = 1
        singles.append(single)
    with torch.no_grad():
        outputs = model(pixel_values, num_core_tokens=torch.tensor(budgets), pixel_mask=pixel_mask)
        for index, (budget, single) in enumerate(zip(budgets, singles, strict=True)):
            alone = model(single, num_core_tokens=budget)
            patches = outputs.last_hidden_state[index, max(budgets) :][outputs.patch_mask[index]]
            torch.testing.assert_close(patches, alone.last_hidden_state[0, budget:], atol=ATOL, rtol=0)
            torch.testing.assert_close(outputs.pooler_output[index], alone.pooler_output[0], atol=ATOL, rtol=0)


def test_masked_attention_gives_unused_cores_no_weight():
    model = tiny(group=False)
    with torch.no_grad():
        outputs = model(images(), num_core_tokens=BUDGETS, output_attentions=True, output_hidden_states=True)
    largest = max(BUDGETS)
    assert len(outputs.attentions) == 3 and len(outputs.hidden_states) == 4
    for attentions in outputs.attentions:  # (B, H, T, T)
        for index, budget in enumerate(BUDGETS):
            # no used core and no patch looks at a core the image does not use
            looking = torch.cat((attentions[index, :, :budget], attentions[index, :, largest:]), dim=1)
            assert not looking[..., budget:largest].any()
            torch.testing.assert_close(looking.sum(-1), torch.ones_like(looking.sum(-1)))


def test_grouped_and_masked_runs_return_the_same_outputs():
    grouped, masked = tiny(group=True), tiny(group=False)
    pixel_values = images()
    kwargs = dict(num_core_tokens=BUDGETS, output_attentions=True, output_hidden_states=True)
    with torch.no_grad():
        by_group, by_mask = grouped(pixel_values, **kwargs), masked(pixel_values, **kwargs)
    torch.testing.assert_close(by_group.last_hidden_state, by_mask.last_hidden_state, atol=ATOL, rtol=0)
    assert torch.equal(by_group.core_mask, by_mask.core_mask)
    for index, budget in enumerate(BUDGETS):  # hidden states and maps agree where they mean something
        used = torch.cat((torch.arange(budget), torch.arange(max(BUDGETS), by_mask.last_hidden_state.shape[1])))
        for group_states, mask_states in zip(by_group.hidden_states, by_mask.hidden_states, strict=True):
            torch.testing.assert_close(group_states[index, used], mask_states[index, used], atol=ATOL, rtol=0)
        for group_map, mask_map in zip(by_group.attentions, by_mask.attentions, strict=True):
            torch.testing.assert_close(
                group_map[index][:, used][:, :, used], mask_map[index][:, used][:, :, used], atol=ATOL, rtol=0
            )


def test_grouping_follows_the_config(monkeypatch):
    calls = []
    original = VecaModel._forward_budget_groups

    def spy(self, *args, **kwargs):
        calls.append(True)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(VecaModel, "_forward_budget_groups", spy)
    with torch.no_grad():
        tiny(group=False)(images(), num_core_tokens=BUDGETS)
        assert not calls
        tiny(group=True)(images(), num_core_tokens=BUDGETS)
        assert calls == [True]
        tiny(group=True)(images(2), num_core_tokens=[16, 16])  # one budget: nothing to group
        assert calls == [True]


def test_one_budget_for_every_image_is_the_plain_forward():
    model = tiny(group=True)
    pixel_values = images(3)
    with torch.no_grad():
        plain = model(pixel_values, num_core_tokens=16)
        listed = model(pixel_values, num_core_tokens=np.array([16, 16, 16]))
        single = model(pixel_values, num_core_tokens=[16])
    assert torch.equal(listed.last_hidden_state, plain.last_hidden_state)
    assert listed.core_mask.all() and listed.core_mask.shape == (3, 16)
    assert torch.equal(single.last_hidden_state, plain.last_hidden_state) and single.core_mask is None
    assert plain.core_mask is None


@pytest.mark.parametrize("group", [True, False], ids=["grouped", "masked"])
def test_classifier_and_backbone_take_a_budget_per_image(group):
    classifier = tiny(VecaForImageClassification, group=group, num_labels=5)
    backbone = tiny(VecaBackbone, group=group, out_features=["stage1", "stage3"])
    backbone.load_state_dict(classifier.veca.state_dict(), strict=False)
    pixel_values = images()
    with torch.no_grad():
        logits = classifier(pixel_values, num_core_tokens=BUDGETS).logits
        maps = backbone(pixel_values, num_core_tokens=BUDGETS).feature_maps
        for index, budget in enumerate(BUDGETS):
            single = pixel_values[index : index + 1]
            torch.testing.assert_close(
                logits[index], classifier(single, num_core_tokens=budget).logits[0], atol=ATOL, rtol=0
            )
            for feature_map, alone in zip(maps, backbone(single, num_core_tokens=budget).feature_maps, strict=True):
                assert feature_map.shape[1:] == alone.shape[1:] == (64, 3, 4)
                torch.testing.assert_close(feature_map[index], alone[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("head_class", [VecaForSemanticSegmentation, VecaForDepthEstimation])
def test_dense_heads_take_a_budget_per_image(head_class):
    model = tiny(head_class, group=True, num_labels=3)
    pixel_values = images()
    with torch.no_grad():
        outputs = model(pixel_values, num_core_tokens=BUDGETS)
        predictions = outputs.logits if head_class is VecaForSemanticSegmentation else outputs.predicted_depth
        for index, budget in enumerate(BUDGETS):
            alone = model(pixel_values[index : index + 1], num_core_tokens=budget)
            expected = alone.logits if head_class is VecaForSemanticSegmentation else alone.predicted_depth
            torch.testing.assert_close(predictions[index], expected[0], atol=ATOL, rtol=0)


def test_per_image_budgets_train():
    model = tiny(group=False)
    model.train()
    outputs = model(images(), num_core_tokens=BUDGETS)
    outputs.pooler_output.pow(2).sum().backward()
    cores = model.embeddings.core_tokens
    assert all(chunk.grad is not None and chunk.grad.abs().sum() > 0 for chunk in cores)


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ([8, 16], r"holds 2 budgets for a batch of 5 images"),
        ([8, 16, 12, 8, 8], r"num_core_tokens\[2\]=12 is not a valid budget"),
        ([8, 16, 32, 8, 8], r"num_core_tokens\[2\]=32 is not a valid budget"),
        ([8, 16.0, 8, 8, 8], r"num_core_tokens\[1\]=16.0 is not a valid budget"),
        (torch.tensor([8.0, 16.0, 8.0, 8.0, 8.0]), r"must hold integers"),
        (torch.tensor([[8], [16], [8], [8], [8]]), r"of shape \(5, 1\): pass one int for the batch, or one budget"),
    ],
)
def test_bad_per_image_budgets_name_the_problem(budgets, message):
    with pytest.raises(ValueError, match=message):
        tiny(group=True)(images(), num_core_tokens=budgets)


def test_one_element_arrays_are_one_budget():
    model = tiny(group=True)
    pixel_values = images(batch_size=1)
    with torch.no_grad():
        plain = model(pixel_values, num_core_tokens=16).last_hidden_state
        for budget in (np.array([16]), np.int64(16), torch.tensor([16])):
            assert torch.equal(model(pixel_values, num_core_tokens=budget).last_hidden_state, plain)


def test_masked_budgets_export_as_one_graph_equal_to_eager():
    """The masked path branches on the budgets' Python values only, so `torch.export` captures it as one graph."""
    model = tiny(group=False)
    pixel_values = images()
    exported = torch.export.export(model, (pixel_values,), kwargs={"num_core_tokens": BUDGETS})
    with torch.no_grad():
        eager = model(pixel_values, num_core_tokens=BUDGETS)
    graph_outputs = exported.module()(pixel_values, num_core_tokens=BUDGETS)
    torch.testing.assert_close(graph_outputs.last_hidden_state, eager.last_hidden_state, atol=ATOL, rtol=0)
    torch.testing.assert_close(graph_outputs.pooler_output, eager.pooler_output, atol=ATOL, rtol=0)
