"""transformers' own model tests (`ModelTesterMixin`) for VECA.

Not collected by the suite: it runs inside transformers' test tree, which pip does not install and whose source
release lacks two of the modules it imports. `bash tests/transformers_common/run.sh` (needs PyPI) sets that up.
"""

import unittest

import torch

from veca_hf import VecaBackbone, VecaConfig, VecaForImageClassification, VecaModel

from ...test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor  # transformers' tests/


class VecaModelTester:
    def __init__(
        self,
        parent,
        batch_size=2,
        image_size=32,
        patch_size=16,
        num_channels=3,
        is_training=True,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    ):
        self.parent = parent
        self.batch_size = batch_size
        self.image_size = image_size
        self.patch_size = patch_size
        self.num_channels = num_channels
        self.is_training = is_training
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.num_labels = num_labels
        self.type_sequence_label_size = num_labels
        self.core_bank_size = 16
        self.seq_length = self.core_bank_size + (image_size // patch_size) ** 2
        self.encoder_seq_length = self.seq_length
        self.key_length = self.seq_length

    def get_config(self):
        return VecaConfig(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            core_bank_size=self.core_bank_size,
            core_chunk_size=8,
            image_size=self.image_size,
            patch_size=self.patch_size,
            num_labels=self.num_labels,
        )

    def prepare_config_and_inputs(self):
        pixel_values = floats_tensor([self.batch_size, self.num_channels, self.image_size, self.image_size])
        labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
        return self.get_config(), pixel_values, labels

    def prepare_config_and_inputs_for_common(self):
        config, pixel_values, _ = self.prepare_config_and_inputs()
        return config, {"pixel_values": pixel_values}


class VecaModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (VecaModel, VecaForImageClassification, VecaBackbone)
    pipeline_model_mapping = {}
    test_resize_embeddings = False
    test_torch_exportable = False
    has_attentions = True

    def setUp(self):
        self.model_tester = VecaModelTester(self)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = dict(inputs_dict)
        if return_labels and model_class is VecaForImageClassification:
            inputs_dict["labels"] = torch.zeros(self.model_tester.batch_size, dtype=torch.long)
        return inputs_dict

    # as DINOv2's tester: the input embedding is a patch embedding, not an nn.Embedding
    def test_model_get_set_embeddings(self):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config)
            self.assertIsInstance(model.get_input_embeddings(), torch.nn.Module)

    # training tests run on the classes with a loss (transformers skips base models by its own mapping, which
    # does not list VECA)
    def _with_loss_classes_only(self, test):
        classes = self.all_model_classes
        self.all_model_classes = (VecaForImageClassification,)
        try:
            test()
        finally:
            self.all_model_classes = classes

    def test_training(self):
        self._with_loss_classes_only(super().test_training)

    def test_training_gradient_checkpointing(self):
        self._with_loss_classes_only(super().test_training_gradient_checkpointing)

    def test_training_gradient_checkpointing_use_reentrant_false(self):
        self._with_loss_classes_only(super().test_training_gradient_checkpointing_use_reentrant_false)

    def test_training_gradient_checkpointing_use_reentrant_true(self):
        self._with_loss_classes_only(super().test_training_gradient_checkpointing_use_reentrant_true)
