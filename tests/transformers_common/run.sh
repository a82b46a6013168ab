#!/usr/bin/env bash
# transformers' common model tests (ModelTesterMixin) against VECA: bash tests/transformers_common/run.sh [pytest args]
#
# Needs PyPI (not run by CI, which has no network): it downloads the source release of the installed transformers,
# whose tests/ holds test_modeling_common.py, and `parameterized`, into a temporary folder. That release lacks
# tests/exporters and tests/generation: their two mixins are replaced by empty classes, so the torch.export tests
# (covered by tests/test_modeling.py) and the generate tests (VECA does not generate) do not run.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
VERSION="$("$PY" -c 'import transformers; print(transformers.__version__)')"
"$PY" -m pip download -q --no-deps --no-binary :all: "transformers==$VERSION" -d "$WORK/sdist"
"$PY" -m pip install -q --target "$WORK/site" parameterized
tar -xzf "$WORK"/sdist/transformers-*.tar.gz -C "$WORK"
TESTS="$WORK/transformers-$VERSION/tests"
mkdir -p "$TESTS/exporters" "$TESTS/generation" "$TESTS/models/veca"
echo "class ExportTesterMixin: pass" > "$TESTS/exporters/test_export.py"
echo "class GenerationTesterMixin: pass" > "$TESTS/generation/test_utils.py"
touch "$TESTS/__init__.py" "$TESTS/models/__init__.py" "$TESTS/exporters/__init__.py" "$TESTS/generation/__init__.py" "$TESTS/models/veca/__init__.py"
cp "$HERE/veca_model_tester.py" "$TESTS/models/veca/test_modeling_veca.py"
cd "$WORK/transformers-$VERSION"
PYTHONPATH="$WORK/site:$ROOT/src" "$PY" -m pytest -q -p no:cacheprovider -W ignore tests/models/veca "$@"
