"""The per-image budget policy: `AdaptiveBudget.fit` and `num_core_tokens="auto"`.

The policy's picks are what the model runs (each image equals its own forward at its picked budget), its threshold
meets the cost target it was fitted for, it travels with the folder and reaches pipelines through
`default_num_core_tokens="auto"`, and bad requests name the problem.
"""

import pytest
import torch
from conftest import tiny_config
from PIL import Image
from transformers import AutoImageProcessor, pipeline

from veca_hf import AdaptiveBudget, VecaConfig, VecaForImageClassification, VecaImageProcessorPil, VecaModel
from veca_hf.arguments import BudgetArguments
from veca_hf.budget_policy import cascade_costs, policy_training_data, ridge, threshold_for_cost
from veca_hf.flops import veca_model_flops
from veca_hf.model.image_budgets_veca import budget_policy_features, first_budget_within
from veca_hf.training.scripts import eval_budgets_from_args


ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return VecaModel(tiny_config(core_bank_size=32, num_hidden_layers=2)).eval()


@pytest.fixture(scope="module")
def pixel_values():
    return torch.randn(60, 3, 64, 64, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def fitted(model, pixel_values):
    policy = AdaptiveBudget.fit(model, pixel_values[:40], target_mean_cost=0.75)
    return model, policy


def test_fit_sets_the_policy_and_meets_its_cost_target(fitted):
    model, policy = fitted
    assert model.config.adaptive_budget == AdaptiveBudget.from_model(model).__dict__
    assert policy.budgets == [8, 16, 32] and policy.fit_resolution == [64, 64]
    assert len(policy.weight) == 2 and len(policy.weight[0]) == 2 * model.config.hidden_size
    first_pass_cost = veca_model_flops(model.config, 64, 64, 8) / veca_model_flops(model.config, 64, 64, 32)
    assert first_pass_cost <= policy.mean_cost <= policy.target_mean_cost == 0.75


def test_auto_runs_every_image_at_its_picked_budget(fitted, pixel_values):
    model, policy = fitted
    held_out = pixel_values[40:]
    with torch.no_grad():
        outputs = model(held_out, num_core_tokens="auto")
        picked = outputs.core_mask.sum(dim=1).tolist()
        # the model picks what the policy's own rule picks from the first pass
        first_pass = model(held_out, num_core_tokens=policy.budgets[0])
        features = budget_policy_features(first_pass).double()
        weight, mean = torch.tensor(policy.weight, dtype=torch.float64), torch.tensor(policy.feature_mean)
        predicted = (features - mean.double()) @ weight.T + torch.tensor(policy.bias, dtype=torch.float64)
        assert picked == [policy.budgets[i] for i in first_budget_within(predicted, policy.threshold).tolist()]
        assert len(set(picked)) > 1, "the test needs images that the policy sends to different budgets"
        for index, budget in enumerate(picked):
            alone = model(held_out[index : index + 1], num_core_tokens=budget)
            torch.testing.assert_close(outputs.pooler_output[index], alone.pooler_output[0], atol=ATOL, rtol=0)
            torch.testing.assert_close(
                outputs.last_hidden_state[index, max(picked) :], alone.last_hidden_state[0, budget:], atol=ATOL, rtol=0
            )


def test_the_first_pass_serves_the_images_that_stay(fitted, pixel_values, monkeypatch):
    model, policy = fitted
    budgets_run = []
    original = VecaModel.forward

    def spy(self, pixel_values, num_core_tokens=None, *args, **kwargs):
        budgets_run.append((num_core_tokens, len(pixel_values)))
        return original(self, pixel_values, num_core_tokens, *args, **kwargs)

    monkeypatch.setattr(VecaModel, "forward", spy)
    with torch.no_grad():
        picked = model(pixel_values[40:], num_core_tokens="auto").core_mask.sum(dim=1).tolist()
    runs = budgets_run[1:]  # after the outer call
    assert runs[0] == (8, 20)  # the first pass, every image
    assert sorted(runs[1:]) == sorted((b, picked.count(b)) for b in set(picked) if b != 8)  # no image runs 8 twice


def test_a_batch_that_stays_at_the_first_budget_runs_once(fitted, pixel_values, monkeypatch):
    model, policy = fitted
    monkeypatch.setitem(model.config.adaptive_budget, "threshold", float("inf"))  # every image stays at 8
    with torch.no_grad():
        outputs = model(pixel_values[40:], num_core_tokens="auto")
        alone = model(pixel_values[40:], num_core_tokens=8)
    assert outputs.core_mask.shape == (20, 8) and outputs.core_mask.all()
    assert torch.equal(outputs.last_hidden_state, alone.last_hidden_state)


def test_the_policy_travels_with_the_folder_and_reaches_pipelines(fitted, pixel_values, tmp_path):
    model, policy = fitted
    model.save_pretrained(tmp_path)
    VecaImageProcessorPil.for_resolution(64).save_pretrained(tmp_path)
    reloaded = VecaModel.from_pretrained(tmp_path).eval()
    assert AdaptiveBudget.from_model(reloaded) == policy
    with torch.no_grad():
        before = model(pixel_values[40:], num_core_tokens="auto")
        after = reloaded(pixel_values[40:], num_core_tokens="auto")
    assert torch.equal(before.core_mask, after.core_mask)
    torch.testing.assert_close(before.last_hidden_state, after.last_hidden_state)

    extract = pipeline(
        "image-feature-extraction",
        model=str(tmp_path),
        trust_remote_code=False,
        model_kwargs={"default_num_core_tokens": "auto"},
    )
    image = Image.fromarray((torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy())
    features = extract(image, return_tensors=True)
    inputs = AutoImageProcessor.from_pretrained(tmp_path)(image, return_tensors="pt")
    with torch.no_grad():
        budget = int(reloaded(**inputs, num_core_tokens="auto").core_mask.sum())
        expected = reloaded(**inputs, num_core_tokens=budget).last_hidden_state
    assert features.shape == expected.shape == (1, budget + 16, 64)
    torch.testing.assert_close(features, expected, atol=ATOL, rtol=0)


def test_a_classifier_takes_auto(fitted, pixel_values):
    model, _ = fitted
    classifier = VecaForImageClassification(VecaConfig(**{**model.config.to_dict(), "num_labels": 3})).eval()
    classifier.veca.load_state_dict(model.state_dict())
    with torch.no_grad():
        picked = model(pixel_values[40:44], num_core_tokens="auto").core_mask.sum(dim=1).tolist()
        logits = classifier(pixel_values[40:44], num_core_tokens="auto").logits
        for index, budget in enumerate(picked):
            alone = classifier(pixel_values[40 + index : 41 + index], num_core_tokens=budget).logits[0]
            torch.testing.assert_close(logits[index], alone, atol=ATOL, rtol=0)


def test_the_threshold_trades_cost_for_fidelity_monotonically():
    generator = torch.Generator().manual_seed(0)
    predicted = torch.rand(200, 3, generator=generator, dtype=torch.float64).sort(dim=1, descending=True).values
    costs = torch.tensor([0.3, 0.45, 0.65, 1.0], dtype=torch.float64)
    thresholds, mean_costs = [], []
    for target in (0.3, 0.5, 0.7, 0.9, 1.1, 1.3):
        threshold, mean_cost = threshold_for_cost(predicted, costs, target)
        assert mean_cost <= target + 1e-12
        assert mean_cost == pytest.approx(
            float(cascade_costs(first_budget_within(predicted, threshold), costs).mean())
        )
        thresholds.append(threshold)
        mean_costs.append(mean_cost)
    assert thresholds == sorted(thresholds, reverse=True)  # more cost allowed: a stricter threshold
    assert mean_costs == sorted(mean_costs)
    assert mean_costs[0] == pytest.approx(0.3)  # everyone stops at the first pass
    assert mean_costs[-1] == pytest.approx(1.3)  # everyone runs again at the largest budget


def test_ridge_recovers_a_linear_map():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(300, 10, generator=generator, dtype=torch.float64)
    true_weight = torch.randn(10, 2, generator=generator, dtype=torch.float64)
    targets = features @ true_weight + torch.tensor([0.5, -1.0], dtype=torch.float64)
    mean = features.mean(dim=0)
    weight, bias = ridge(features - mean, targets, penalty=1e-6)
    torch.testing.assert_close((features - mean) @ weight + bias, targets, atol=1e-6, rtol=0)


def test_the_training_targets_are_distances_to_the_largest_budget(model, pixel_values):
    features, distances = policy_training_data(model, [pixel_values[:6]], [8, 16, 32], batch_size=4)
    assert features.shape == (6, 128) and distances.shape == (6, 2)
    with torch.no_grad():
        at_8 = model(pixel_values[:6], num_core_tokens=8).pooler_output
        at_32 = model(pixel_values[:6], num_core_tokens=32).pooler_output
    torch.testing.assert_close(distances[:, 0].float(), 1 - torch.cosine_similarity(at_8, at_32), atol=1e-6, rtol=0)
    assert (distances >= -1e-9).all()


def test_bad_requests_name_the_problem(model, pixel_values):
    fresh = VecaModel(tiny_config(core_bank_size=32, num_hidden_layers=2)).eval()
    with pytest.raises(ValueError, match=r"needs a budget policy in config.adaptive_budget"):
        fresh(pixel_values[:2], num_core_tokens="auto")
    with pytest.raises(ValueError, match=r"num_core_tokens='eight' is not a budget"):
        fresh(pixel_values[:2], num_core_tokens="eight")
    with pytest.raises(ValueError, match=r"target_mean_cost=0.1 is out of reach"):
        AdaptiveBudget.fit(fresh, pixel_values[:20], target_mean_cost=0.1)
    with pytest.raises(ValueError, match=r"images of one size"):
        AdaptiveBudget.fit(fresh, [pixel_values[:20], torch.randn(20, 3, 32, 32)], target_mean_cost=0.8)
    with pytest.raises(ValueError, match=r"at least 10 images, got 4"):
        AdaptiveBudget.fit(fresh, pixel_values[:4], target_mean_cost=0.8)
    with pytest.raises(ValueError, match=r"budgets=\[16, 8\] must be two or more increasing budgets"):
        AdaptiveBudget.fit(fresh, pixel_values[:20], target_mean_cost=0.8, budgets=[16, 8])
    with pytest.raises(ValueError, match=r"default_num_core_tokens='auto' needs a budget policy"):
        tiny_config(default_num_core_tokens="auto")
    with pytest.raises(ValueError, match=r"adaptive_budget lacks \['bias', 'weight'\]"):
        tiny_config(adaptive_budget={"budgets": [8, 16], "threshold": 0.1, "feature_mean": [0.0] * 128})
    policy = {"budgets": [8, 16], "threshold": 0.1, "feature_mean": [0.0] * 10, "weight": [[0.0] * 10], "bias": [0]}
    with pytest.raises(ValueError, match=r"do not fit this model: it needs feature_mean of 128"):
        tiny_config(adaptive_budget=policy)
    with pytest.raises(ValueError, match=r"holds no VecaModel"):
        AdaptiveBudget.fit(torch.nn.Linear(2, 2), pixel_values[:20], target_mean_cost=0.8)


def test_auto_is_refused_inside_a_graph_and_has_no_single_flop_count(fitted, pixel_values):
    """A traced graph would keep the picks of its example inputs for every later batch; 'auto' has no one budget."""
    model, _ = fitted

    class Auto(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.veca = model

        def forward(self, pixel_values):
            return self.veca(pixel_values, num_core_tokens="auto").pooler_output

    with pytest.raises(ValueError, match=r"a traced, compiled or exported graph cannot do"):
        torch.jit.trace(Auto(), pixel_values[:4], check_trace=False)
    config = VecaConfig(**{**model.config.to_dict(), "default_num_core_tokens": "auto"})
    with pytest.raises(ValueError, match=r"num_core_tokens='auto' has no FLOP count of its own"):
        veca_model_flops(config, 64, 64)
    # the fine-tuning scripts evaluate at the smallest and the largest budget when the default is 'auto'
    assert eval_budgets_from_args(BudgetArguments(), VecaModel(config)) == [8, 32]
