"""`run`: `subprocess.run` of `python SCRIPT ARGS` for the tests, minus most of the interpreter's start-up.

A new interpreter spends 5-6 s of CPU importing torch, torchvision, transformers, datasets and accelerate before a
script's first line does anything; most script runs in the suite are that import. `run` forks the script from a
*zygote*: an interpreter that has imported those libraries (nothing else: not `veca_hf`, so a script that forgets
`import veca_hf` still fails) and runs each request in a child forked from it, with the request's argv, environment,
working directory, sys.path and file descriptors, `__name__ == "__main__"`, and Python's exit sequence (non-daemon
threads joined, atexit handlers, exit code; an uncaught exception prints its traceback and exits 1).

Libraries read some environment variables when imported (Hugging Face cache and endpoint paths, OpenMP threads), so
a zygote serves only requests whose environment equals the one it was started with, except for the variables in
`RUNTIME_VARIABLES` (read when used). Any other command, environment or option falls back to `subprocess.run`.

    python tests/warm_python.py    # the zygote itself: started by `run`, one per test worker and environment
"""

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Iterator
from pathlib import Path


PRELOAD = (
    "numpy",
    "PIL.Image",
    "torch",
    "torchvision",
    "transformers.image_processing_utils",
    "transformers.modeling_utils",
    "transformers.models.auto",
    "datasets",
    "accelerate",
)
# Read when used, not when imported: may differ between a request and its zygote.
RUNTIME_VARIABLES = ("ACCELERATE_", "VECA_HF_TEST_", "PYTEST_", "PYTHONPATH", "PYTHONUNBUFFERED")
MAX_ZYGOTES = 3  # per test worker: one per environment seen


# ---------------------------------------------------------------------------------------------------------------------
# The client (in the test process)
# ---------------------------------------------------------------------------------------------------------------------


def import_time_environment(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(RUNTIME_VARIABLES)))


class Zygote:
    def __init__(self, env: dict):
        self.lock = threading.Lock()
        # NOTE: unbuffered bytes: `readline` then reads no further than its line, so `select` sees every message
        # not yet read.
        self.process = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0
        )
        if self.receive(deadline=time.monotonic() + 300) != {"ready": True}:
            raise RuntimeError("the zygote did not start")

    def receive(self, deadline: float | None) -> dict | None:
        """The zygote's next message, or None when `deadline` passes first."""
        stream = self.process.stdout
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([stream], [], [], timeout)[0]:
            return None
        line = stream.readline()
        if not line:
            raise RuntimeError(f"the zygote exited (code {self.process.poll()})")
        return json.loads(line)

    def run(self, request: dict, timeout: float | None) -> int | None:
        """The child's exit code, or None when it ran past `timeout` (it is killed)."""
        message = memoryview((json.dumps(request) + "\n").encode())
        while message:  # an unbuffered write may take part of it
            message = message[self.process.stdin.write(message) :]
        pid = self.receive(deadline=None)["pid"]
        reply = self.receive(deadline=None if timeout is None else time.monotonic() + timeout)
        if reply is None:  # as subprocess.run does on a timeout: kill the child, then wait for it
            with contextlib.suppress(ProcessLookupError):  # it may have ended since
                os.kill(pid, signal.SIGKILL)
            self.receive(deadline=None)
            return None
        return reply["returncode"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


_zygotes: dict[tuple, Zygote] = {}


def _zygote_for(env: dict) -> Zygote | None:
    key = import_time_environment(env)
    zygote = _zygotes.get(key)
    if zygote is not None and zygote.process.poll() is not None:  # killed (a test that kills all its children)
        del _zygotes[key]
        zygote = None
    if zygote is None and len(_zygotes) < MAX_ZYGOTES:
        zygote = _zygotes[key] = Zygote(dict(key))
    return zygote


@atexit.register
def _close_zygotes() -> None:
    for zygote in _zygotes.values():
        zygote.close()


def _output_path(stream) -> str | None:
    name = getattr(stream, "name", None)
    return name if isinstance(name, str) and os.path.isfile(name) else None


def run(command: list, *, env: dict | None = None, cwd=None, timeout: float | None = None, capture_output=False,
        text=False, stdout=None, stderr=None) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run(command, ...)` for `[sys.executable, "<script>.py", *args]` with `capture_output=True,
    text=True`, or with `stdout=<a file opened for appending>, stderr=subprocess.STDOUT`; anything else is passed to
    `subprocess.run` unchanged."""
    command = [str(part) for part in command]
    env = dict(os.environ if env is None else env)
    fallback = dict(env=env, cwd=cwd, timeout=timeout, capture_output=capture_output, text=text, stdout=stdout,
                    stderr=stderr)  # fmt: skip
    log_path = _output_path(stdout) if stderr == subprocess.STDOUT and not capture_output else None
    captured = capture_output and text and stdout is None and stderr is None
    is_script = len(command) >= 2 and command[0] == sys.executable and command[1].endswith(".py")
    zygote = _zygote_for(env) if is_script and (captured or log_path) else None
    if zygote is None or not zygote.lock.acquire(blocking=False):  # another thread of this test is using it
        return subprocess.run(command, **fallback)
    try:
        with _output_files(captured, log_path) as (out_path, err_path):
            request = dict(argv=command[1:], env=env, cwd=str(Path(cwd or os.getcwd()).resolve()), stdout=out_path,
                           stderr=err_path, append=log_path is not None)  # fmt: skip
            if log_path is not None:
                stdout.flush()
            returncode = zygote.run(request, timeout)
            output = Path(out_path).read_text(errors="replace") if captured else None
            errors = Path(err_path).read_text(errors="replace") if captured else None
    finally:
        zygote.lock.release()
    if returncode is None:
        raise subprocess.TimeoutExpired(command, timeout, output=output, stderr=errors)
    return subprocess.CompletedProcess(command, returncode, output, errors)


def as_subprocess_module() -> types.SimpleNamespace:
    """A stand-in for the `subprocess` module of code that runs scripts with `subprocess.run` (the studies' stages):
    `monkeypatch.setattr(module, "subprocess", warm_python.as_subprocess_module())`."""
    return types.SimpleNamespace(run=run, STDOUT=subprocess.STDOUT)


@contextlib.contextmanager
def _output_files(captured: bool, log_path: str | None) -> Iterator[tuple[str, str | None]]:
    """Two temporary files (stdout, stderr) for a captured run, or the log file (both streams) of an uncaptured one."""
    if not captured:
        yield log_path, None
        return
    with tempfile.TemporaryDirectory(prefix="warm-python-") as folder:
        yield os.path.join(folder, "stdout"), os.path.join(folder, "stderr")


# ---------------------------------------------------------------------------------------------------------------------
# The zygote (`python tests/warm_python.py`)
# ---------------------------------------------------------------------------------------------------------------------


def _exit_code(code) -> int:
    """What the interpreter exits with for `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_child(request: dict, library_path: list[str]) -> None:
    """In the forked child: become `python argv...` and exit as it would."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(request["stdout"], flags), 1)
        os.dup2(os.open(request["stderr"], flags) if request["stderr"] else 1, 2)
        script = os.path.abspath(request["argv"][0])
        python_path = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(script), *python_path, *library_path]
        sys.argv = request["argv"]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = _exit_code(exit_.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # as the interpreter's exit: join non-daemon threads, then the atexit handlers
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve() -> None:
    for module in PRELOAD:
        importlib.import_module(module)
    library_path = sys.path[1:]  # without this file's folder
    protocol = sys.stdout
    print(json.dumps({"ready": True}), file=protocol, flush=True)
    for line in iter(sys.stdin.readline, ""):
        pid = os.fork()
        if pid == 0:
            _run_child(json.loads(line), library_path)
        print(json.dumps({"pid": pid}), file=protocol, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=protocol, flush=True)


if __name__ == "__main__":
    serve()
