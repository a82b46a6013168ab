"""A test-only entry point: `examples/extract_features.py` killed at a chosen point, by patching.

    python tests/extract_with_faults.py <extract_features.py arguments>

`VECA_HF_TEST_KILL_AT_PART=N`: the process SIGKILLs itself while writing its N-th part file (1-based), after the
temporary file is on disk and before it is renamed: the worst moment for a run to die.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

import veca_hf.embedding


SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "extract_features.py"


def inject() -> None:
    kill_at = int(os.environ["VECA_HF_TEST_KILL_AT_PART"])
    write_atomically = veca_hf.embedding._write_atomically
    parts = []

    def killed_while_writing(path, write):
        if path.name.startswith("part-"):
            parts.append(path.name)
            if len(parts) == kill_at:
                write(path.with_name(f".{path.name}.tmp{os.getpid()}"))
                os.kill(os.getpid(), signal.SIGKILL)
        write_atomically(path, write)

    veca_hf.embedding._write_atomically = killed_while_writing


if __name__ == "__main__":
    inject()
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")
