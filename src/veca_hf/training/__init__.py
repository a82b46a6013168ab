# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Training machinery: distillation (`distillation`, and a run of it with Accelerate: `distillation_run`), fine-tuning
with `Trainer` (`trainer`), optimisers and schedules (`optimization`), atomic checkpoints (`checkpointing`) and what
keeps long runs alive (`faults`).

Nothing is imported here, so importing one module (e.g. the checkpoints) does not load `Trainer`.
"""
