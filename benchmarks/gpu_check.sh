#!/usr/bin/env bash
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
#
# One-command GPU check, under 8 minutes on one H200; prints one compact table, writes JSON.
#
#   benchmarks/gpu_check.sh [--dry-run] [OUT_DIR]       # OUT_DIR default: $OUT if set, else benchmarks/results/gpu_check
#   GPU_CHECK_DRY_RUN=1 benchmarks/gpu_check.sh         # the same stages at tiny sizes on CPU (about a minute)
#
# Stages (each under its own time limit; a failing stage is recorded and the next one runs):
#   1. scaling    bf16 VECA-B (C = 64) vs DINOv3-B at 1024/2048/4096 px, batch 8: latency, peak memory
#                 (benchmarks/scaling.py --device cuda --dtype bf16 --no_profile)
#   kernels       each attention kernel (sdpa, flash_attention_2 / _3 where installed, flex_attention): VECA-B
#                 (C = 8, 64) vs DINOv3-B at 224/512/1024 px, batch 8, a bf16 forward and a bf16-autocast training
#                 step (benchmarks/gpu_check_helpers.py kernels)
#   2. precision  eager vs sdpa in bf16, and bf16 autocast vs fp32 (benchmarks/numerics.py precision)
#   3. distill    20 steps of `accelerate launch examples/distill.py` in bf16 on 1 GPU, resumed once from the
#                 step-10 checkpoint into a second run; the two final students are compared
#   4. zero2, zero3  the same under DeepSpeed ZeRO-2 / ZeRO-3 (examples/configs/deepspeed_zero{2,3}.yaml with
#                 num_processes 1); skipped, with the reason printed, without CUDA or without deepspeed
# Teacher and data are generated (a tiny random DINOv3 saved from a config, 48 random images): no Hub needed.
#
# Files: OUT_DIR/gpu_check.json (all of it), OUT_DIR/scaling/results.{json,md}, OUT_DIR/kernels.json,
# OUT_DIR/precision/results.json, OUT_DIR/stages.jsonl, OUT_DIR/gpu_check.log. Training runs and checkpoints go to a temporary folder.
# Packages missing on the GPU machine (datasets, deepspeed, a newer transformers) can travel as wheels in ./.whl:
# they are installed into /tmp/site when that folder exists (see docs/performance.md).

set -uo pipefail

DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
POSITIONAL=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) sed -n '3,28p' "$0"; exit 0 ;;
        *) POSITIONAL+=("$arg") ;;
    esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUT_DIR="${POSITIONAL[0]:-${OUT:-$ROOT/benchmarks/results/gpu_check}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PY="${PYTHON:-python3}"
if [ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ]; then PY="$ROOT/.venv/bin/python"; fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
LOG="$OUT_DIR/gpu_check.log"
STAGES="$OUT_DIR/stages.jsonl"
: > "$LOG"
: > "$STAGES"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ -d "$ROOT/.whl" ] && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$ROOT"/.whl/*.whl >>"$LOG" 2>&1 && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$ROOT/src:${PYTHONPATH:-}"

HAS_CUDA="$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)"
if [ "$DRY_RUN" != "1" ] && [ "$HAS_CUDA" != "1" ]; then
    echo "No CUDA device: run with --dry-run (GPU_CHECK_DRY_RUN=1) for the CPU path." >&2
    exit 2
fi
echo "gpu_check: dry run $DRY_RUN, CUDA $HAS_CUDA, python $PY, out $OUT_DIR, work $WORK" | tee -a "$LOG"

record() {  # stage status seconds detail
    local detail="${4//\"/\'}"
    printf '{"stage": "%s", "status": "%s", "seconds": %s, "detail": "%s"}\n' "$1" "$2" "$3" "$detail" >>"$STAGES"
    echo "[$1] $2 (${3}s) $detail" | tee -a "$LOG"
}

run_stage() {  # name limit_s command...: runs with a time limit, output to the log
    local name="$1" limit="$2"; shift 2
    local start=$SECONDS
    echo "[$name] $*" >>"$LOG"
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    local took=$((SECONDS - start))
    if [ $rc -eq 0 ]; then STAGE_STATUS=ok; elif [ $rc -eq 124 ]; then STAGE_STATUS="timeout"; else STAGE_STATUS="failed"; fi
    STAGE_SECONDS=$took
    STAGE_RC=$rc
}

# --- 1. scaling -----------------------------------------------------------------------------------------------------
if [ "$DRY_RUN" = "1" ]; then
    SCALING_ARGS=(--tiny --size veca-b16 --device cpu --dtype bf16 --resolutions 64,128 --batch_sizes 2 --budgets 16
                  --warmup 0 --repeats 1 --gemm_size 128 --gemm_repeats 1 --bf16_probe_size 0 --threads 1)
else
    SCALING_ARGS=(--size veca-b16 --device cuda --dtype bf16 --resolutions 1024,2048,4096 --batch_sizes 8 --budgets 64
                  --warmup 2 --repeats 5 --gemm_size 8192 --gemm_repeats 5)
fi
run_stage scaling 240 "$PY" benchmarks/scaling.py "${SCALING_ARGS[@]}" --no_profile --no_plots \
    --output_dir "$OUT_DIR/scaling"
record scaling "$STAGE_STATUS" "$STAGE_SECONDS" "exit $STAGE_RC"

# --- kernels: every attention kernel, forward and training step ------------------------------------------------------
KERNEL_ARGS=()
if [ "$DRY_RUN" = "1" ]; then KERNEL_ARGS=(--dry_run); fi
run_stage kernels 200 "$PY" benchmarks/gpu_check_helpers.py kernels "$OUT_DIR" "${KERNEL_ARGS[@]}"
record kernels "$STAGE_STATUS" "$STAGE_SECONDS" "exit $STAGE_RC (rows measured before a time-out are kept)"

# --- 2. precision ---------------------------------------------------------------------------------------------------
if [ "$DRY_RUN" = "1" ]; then
    PRECISION_ARGS=(--tiny --device cpu --resolutions 64 --batch_size 2 --bf16_probe_size 0 --threads 1)
else
    PRECISION_ARGS=(--size veca-b16 --device cuda --resolutions 512,1024 --batch_size 2)
fi
run_stage precision 120 "$PY" benchmarks/numerics.py precision "${PRECISION_ARGS[@]}" \
    --checks eager_sdpa,bf16_autocast --eager_sdpa_dtype bf16 --output_dir "$OUT_DIR/precision"
record precision "$STAGE_STATUS" "$STAGE_SECONDS" "exit $STAGE_RC (a cosine below 0.999 is reported in the table, not a failure)"

# --- 3-4. distillation: 1 GPU bf16, DeepSpeed ZeRO-2, ZeRO-3, each resumed once --------------------------------------
if [ "$DRY_RUN" = "1" ]; then STEPS=4; else STEPS=20; fi
HALF=$((STEPS / 2))
DISTILL_ARGS=(--teacher_name_or_path "$WORK/ws/teacher" --student_config "$WORK/ws/student"
              --dataset_name "$WORK/ws/images" --resolution 64 --validation_size 8 --per_device_train_batch_size 4
              --per_device_eval_batch_size 4 --max_train_steps "$STEPS" --warmup_steps 2 --learning_rate 1e-3
              --min_learning_rate 1e-4 --budgets 8,16 --budget_weights 1,1 --checkpointing_steps "$HALF"
              --checkpoints_total_limit 3 --validation_steps "$STEPS" --dataloader_num_workers 0
              --shuffle_buffer_size 16 --model_card_latency false --logging_steps 5 --seed 0)
HAVE_DATASETS="$("$PY" -c 'import datasets, accelerate; print(1)' 2>/dev/null || echo 0)"
HAVE_DEEPSPEED="$("$PY" -c 'import deepspeed; print(1)' 2>/dev/null || echo 0)"
if [ "$HAVE_DATASETS" = "1" ]; then
    run_stage workspace 120 "$PY" benchmarks/gpu_check_helpers.py workspace "$WORK/ws"
    [ "$STAGE_STATUS" = ok ] || record workspace "$STAGE_STATUS" "$STAGE_SECONDS" "exit $STAGE_RC"
fi

distill_stage() {  # name reason_to_skip launcher...
    local name="$1" skip="$2"; shift 2
    if [ -n "$skip" ]; then record "$name" skipped 0 "$skip"; return; fi
    local a="$WORK/$name/a" b="$WORK/$name/b" start=$SECONDS
    run_stage "$name" 180 "$@" examples/distill.py "${DISTILL_ARGS[@]}" --output_dir "$a"
    if [ "$STAGE_STATUS" != ok ]; then record "$name" "$STAGE_STATUS" "$STAGE_SECONDS" "first run exit $STAGE_RC"; return; fi
    run_stage "$name" 180 "$@" examples/distill.py "${DISTILL_ARGS[@]}" --output_dir "$b" \
        --resume_from_checkpoint "$a/checkpoints/checkpoint-$HALF"
    if [ "$STAGE_STATUS" != ok ]; then record "$name" "$STAGE_STATUS" "$((SECONDS - start))" "resumed run exit $STAGE_RC"; return; fi
    local cmp
    cmp="$("$PY" benchmarks/gpu_check_helpers.py compare "$a" "$b" 2>>"$LOG" | tail -1)"
    record "$name" ok "$((SECONDS - start))" "$STEPS steps, resumed from step $HALF: $cmp"
}

LAUNCH=("$PY" -m accelerate.commands.launch --num_machines 1 --dynamo_backend no)
SKIP_ALL=""
[ "$HAVE_DATASETS" = "1" ] || SKIP_ALL="python packages datasets/accelerate missing: carry wheels in .whl"
if [ "$DRY_RUN" = "1" ]; then
    ACCELERATE_USE_CPU=true distill_stage distill "$SKIP_ALL" "${LAUNCH[@]}" --cpu --num_processes 1 --mixed_precision bf16
else
    distill_stage distill "$SKIP_ALL" "${LAUNCH[@]}" --num_processes 1 --mixed_precision bf16
fi
for stage in 2 3; do
    reason="$SKIP_ALL"
    if [ -z "$reason" ] && [ "$HAS_CUDA" != "1" ]; then reason="DeepSpeed stages need CUDA (on CPU, DeepSpeed misreports the world size of a custom Accelerate loop: README.md, What has been run)"; fi
    if [ -z "$reason" ] && [ "$HAVE_DEEPSPEED" != "1" ]; then reason="deepspeed is not installed: carry its wheel in .whl"; fi
    sed -e 's/^num_processes: .*/num_processes: 1/' "examples/configs/deepspeed_zero$stage.yaml" >"$WORK/zero$stage.yaml"
    distill_stage "zero$stage" "$reason" "${LAUNCH[@]}" --config_file "$WORK/zero$stage.yaml"
done

"$PY" benchmarks/gpu_check_helpers.py report "$OUT_DIR" | tee -a "$LOG"
rm -rf "$WORK"
