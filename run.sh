#!/usr/bin/env bash
# One entry point that does all set-up on a fresh machine, then runs a job.
#   bash run.sh            the main job (a small offline distillation on embedded defaults, then a probe of it)
#   bash run.sh test       the test suite (what CI runs)
#   bash run.sh test-quick the tests that start no process, server or browser (a few minutes)
#   bash run.sh lint       ruff check and ruff format --check (CI runs it before the tests)
# Extra arguments are passed to the job (pytest flags for `test`).
set -euo pipefail
cd "$(dirname "$0")"

VENV="${VECA_VENV:-.venv}"
STAMP="$VENV/.veca-installed"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# Reinstall only when the dependency list (or this install recipe) changed.
WANT="$(cat setup.cfg pyproject.toml run.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # NOTE: pin torch explicitly first so no dependency range pulls a newer (multi-GB) build.
    "$VENV/bin/python" -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
    "$VENV/bin/python" -m pip install -q -e ".[train,dev,deepspeed,demo,remote,app]"
    echo "$WANT" > "$STAMP"
fi

export HF_HUB_DISABLE_TELEMETRY=1
job="${1:-main}"
[ $# -gt 0 ] && shift
case "$job" in
    test)
        export HF_HUB_OFFLINE=1
        # The demo's browser test drives Debian's Chromium: installed here when missing (as root), never skipped.
        if [ -z "${VECA_HF_CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1; then
            if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
                apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
            else
                echo "tests/test_app.py needs Chromium: 'sudo apt-get install chromium', or set VECA_HF_CHROMIUM" >&2
            fi
        fi
        # One worker per core plus one (pytest-xdist; at most 8), which keeps the cores busy while a test waits for
        # the processes it started; a worker takes the next test as it finishes one.
        workers=$(( $(nproc) + 1 < 8 ? $(nproc) + 1 : 8 ))
        exec "$VENV/bin/python" -m pytest -q -n "$workers" --dist worksteal "$@"
        ;;
    test-quick)
        export HF_HUB_OFFLINE=1
        exec "$VENV/bin/python" -m pytest -q -n auto --dist worksteal -m "not processes and not slow" "$@"
        ;;
    lint)
        "$VENV/bin/ruff" check . "$@"
        exec "$VENV/bin/ruff" format --check .
        ;;
    main)
        # Fashion-MNIST from Debian's dataset-fashion-mnist (installed here when missing, as root; or set
        # VECA_HF_FASHION_MNIST to a folder of its IDX files), real photos from the scikit-image / scikit-learn
        # wheels; a small distillation on 2 CPU cores, then a probe of the student against a random network.
        if [ -z "${VECA_HF_FASHION_MNIST:-}" ] && [ ! -d /usr/share/datasets/fashion-mnist ]; then
            if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
                apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
            else
                echo "the main job needs Fashion-MNIST: 'sudo apt-get install dataset-fashion-mnist', or set VECA_HF_FASHION_MNIST" >&2
                exit 1
            fi
        fi
        "$VENV/bin/python" -m veca_hf.demo photos outputs/demo/photos
        "$VENV/bin/python" -m veca_hf.demo pool outputs/demo/pool --photos_dir outputs/demo/photos
        "$VENV/bin/python" examples/distill.py examples/configs/demo_cpu.yaml "$@"
        exec "$VENV/bin/python" -m veca_hf.demo probe examples/configs/demo_cpu.yaml
        ;;
    *)
        echo "unknown job '$job': use 'bash run.sh' (main job), 'bash run.sh test', 'bash run.sh test-quick' or 'bash run.sh lint'" >&2
        exit 2
        ;;
esac
