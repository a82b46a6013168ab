# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Opt-in helpers for CPU jobs; the model never uses them.

- `allocator`: `tune_cpu_allocator()`, glibc malloc settings for VECA's large CPU intermediates (process-wide, so
  only when the application calls it), and `cpu_allocator_state()`.
- `buffers`: `cpu_inference_buffers(model)`, shared output buffers for inference.
- `hardware`: what the CPU can do (`cpu_bf16_support`), and a warning when bf16 would be slow on it.
"""
