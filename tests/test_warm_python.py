"""`warm_python.run` runs a script as a fresh `python script.py` does: same output, exit code and view of the
process, with no package of this project imported in advance."""

import os
import subprocess
import sys

import pytest
import warm_python


SCRIPT = """
import atexit, os, sys, threading
print("name", __name__, "argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0])
print("env", os.environ.get("VECA_HF_TEST_VALUE"), "veca_hf loaded", "veca_hf" in sys.modules)
print("to stderr", file=sys.stderr)
with open(sys.argv[3], "w") as parent:
    parent.write(str(os.getppid()))
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: print("thread joined")).start()
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.processes
@pytest.mark.parametrize("exit_code", [0, 3])
def test_a_forked_run_looks_like_a_fresh_interpreter(tmp_path, exit_code):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    (tmp_path / "work").mkdir()
    env = {**os.environ, "VECA_HF_TEST_VALUE": "seen"}
    command = [sys.executable, str(script), str(exit_code), "two words", str(tmp_path / "parent")]
    options = dict(env=env, cwd=tmp_path / "work", capture_output=True, text=True, timeout=120)
    fresh = subprocess.run(command, **options)
    assert (tmp_path / "parent").read_text() == str(os.getpid())
    forked = warm_python.run(command, **options)
    assert (tmp_path / "parent").read_text() != str(os.getpid())  # a child of the zygote, not of this process
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == exit_code and "veca_hf loaded False" in forked.stdout
    assert "atexit ran" in forked.stdout and "thread joined" in forked.stdout


@pytest.mark.processes
def test_an_uncaught_error_and_a_timeout_end_as_in_a_fresh_interpreter(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("raise ValueError('bad value 3')\n")
    result = warm_python.run([sys.executable, str(script)], capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.rstrip().endswith("ValueError: bad value 3")
    script.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([sys.executable, str(script)], capture_output=True, text=True, timeout=1)
