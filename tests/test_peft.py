"""LoRA adapters (PEFT) on VECA's linear layers: train, save, reload, merge. A tiny classifier, a fixed batch."""

import pytest
import torch
from conftest import tiny_config

from veca_hf import VecaForImageClassification


peft = pytest.importorskip("peft")

# The attention and MLP linears of every block (docs/usage.md, "LoRA and other PEFT adapters").
TARGET_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def lora_classifier(base: VecaForImageClassification):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGET_MODULES, modules_to_save=["classifier"])
    return peft.get_peft_model(base, config)


@pytest.fixture
def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(6, 3, 32, 48, generator=generator), torch.tensor([0, 1, 2, 0, 1, 2])


def test_lora_targets_every_block_and_freezes_the_rest():
    model = lora_classifier(VecaForImageClassification(tiny_config(num_labels=3)))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    layers = model.base_model.model.config.num_hidden_layers
    assert sum("lora_A" in name for name in trainable) == len(TARGET_MODULES) * layers
    assert all("lora_" in name or "classifier" in name for name in trainable)
    # cores, core coordinates, coordinate heads and norms stay frozen
    assert not any(key in name for name in trainable for key in ("core_", "norm", "patch_embeddings"))


def test_lora_trains_saves_reloads_and_merges(tmp_path, batch):
    pixel_values, labels = batch
    base = VecaForImageClassification(tiny_config(num_labels=3))
    base.save_pretrained(tmp_path / "base")
    model = lora_classifier(base)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(6):
        loss = model(pixel_values=pixel_values, labels=labels, num_core_tokens=8 if step % 2 else 16).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    # the adapter changed the attention output, not only the head
    assert any(p.abs().sum() > 0 for name, p in model.named_parameters() if "lora_B" in name and "qkv_proj" in name)

    model.eval()
    with torch.no_grad():
        adapter_logits = {c: model(pixel_values=pixel_values, num_core_tokens=c).logits for c in (8, 16)}
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    reloaded = peft.PeftModel.from_pretrained(
        VecaForImageClassification.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        for budget, expected in adapter_logits.items():
            torch.testing.assert_close(reloaded(pixel_values=pixel_values, num_core_tokens=budget).logits, expected)
    merged = reloaded.merge_and_unload()
    assert isinstance(merged, VecaForImageClassification)
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        for budget, expected in adapter_logits.items():
            merged_logits = merged(pixel_values, num_core_tokens=budget).logits
            torch.testing.assert_close(merged_logits, expected, atol=1e-5, rtol=1e-5)
