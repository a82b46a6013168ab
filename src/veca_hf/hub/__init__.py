# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What talks to the Hugging Face Hub and writes folders for it.

- `access`: Hub tokens kept off disk (`take_credentials`), and whether a named teacher can be loaded
  (`resolve_teacher`).
- `cards`: VECA model cards (`write_model_card`, `write_finetuned_model_card`), repositories and uploads
  (`create_hub_repo`, `push_to_hub`), and `load_saved_model` for any saved VECA folder.
- `convert_veca_original`: reference checkpoints to a model folder (the `veca-convert` command).
- `export_onnx`: one budget of a saved model to ONNX, and int8 (`python -m veca_hf.hub.export_onnx`).

Nothing is imported here: `veca_hf.hub.access` loads without the card and export code.
"""
