# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""The VECA model, as a transformers model folder holds it: config, modeling, positions, image processors and the
converter of the reference checkpoints. All but the converter travel with saved folders (`trust_remote_code=True`).
The public classes are imported from `veca_hf`."""
