"""Two machines simulated on loopback: two `accelerate launch --num_machines 2` launchers of one CPU process each,
writing into one shared `--output_dir`, against one machine running both processes."""

import contextlib
import signal
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from test_distill_script import (  # noqa: F401  (workspace: the module-scoped fixture of tiny teacher, config, images)
    FAULTS_SCRIPT,
    INTERRUPTED_RUN,
    assert_same_final_weights,
    distill_args,
    first_log_line,
    run_distill,
    start_when_checkpoint_2_exists,
    two_cpu_processes,
    workspace,
)


# The same flags for every run, as a job script that is always started with `latest` would pass them.
RUN = {**INTERRUPTED_RUN, "dataloader_num_workers": 0, "resume_from_checkpoint": "latest"}
TIMEOUT = 180  # seconds: a launcher waiting for a peer that never comes fails the test instead of blocking it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def machine(port: int, machine_rank: int) -> list[str]:
    """`two_cpu_processes` split over two machines: this launcher starts 1 of the 2 processes, as node
    `machine_rank`, and node 0 hosts the rendezvous at 127.0.0.1:`port`."""
    launcher = two_cpu_processes(port)
    launcher[launcher.index("--num_machines") + 1] = "2"
    return launcher + ["--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1"]


def kill_started_processes() -> None:
    """SIGKILL every launcher and worker this test started, as when their machines are lost (torchrun starts each
    worker in a session of its own, so killing a launcher alone would leave its worker running)."""
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def run_two_machines(args: list[str], machine_1_args: list[str] | None = None, check: bool = True):
    """Both launchers at once, as two nodes' job scripts would start them (machine 1 with `machine_1_args` if
    given); returns both results."""
    port = free_port()
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = [
                pool.submit(run_distill, arguments, launcher=machine(port, rank), timeout=TIMEOUT, check=check)
                for rank, arguments in enumerate((args, machine_1_args or args))
            ]
            return [run.result() for run in runs]
    finally:  # a launcher that timed out leaves its worker behind
        kill_started_processes()


@pytest.fixture(scope="module")
def one_machine_run(workspace, tmp_path_factory):  # noqa: F811
    """The reference: one launcher of both processes (`--num_machines 1 --num_processes 2`), never interrupted."""
    output_dir = tmp_path_factory.mktemp("one-machine")
    run_distill(distill_args(workspace, output_dir, **RUN), launcher=two_cpu_processes(free_port()), timeout=TIMEOUT)
    return output_dir


@pytest.mark.processes
def test_two_machines_end_with_the_weights_of_one_machine(workspace, tmp_path, one_machine_run):  # noqa: F811
    """Same world size, same ranks, same data shards and the same gloo all-reduce of two tensors, whether the peer is
    on this launcher or another one: the weights are bit-identical, not just close."""
    output_dir = tmp_path / "two-machines"
    result = run_two_machines(distill_args(workspace, output_dir, **RUN))[0]
    assert "Mixed precision: no; 2 process(es) on cpu" in first_log_line(result)
    checkpoint = output_dir / "checkpoints" / "checkpoint-8"
    assert (checkpoint / "process_state_0.json").is_file() and (checkpoint / "process_state_1.json").is_file()
    assert not list((output_dir / "checkpoints").glob(".shared-folder-check-*"))  # the shared-folder probe is gone
    assert_same_final_weights(one_machine_run, output_dir)


@pytest.mark.processes
def test_both_machines_killed_then_relaunched_resume_to_the_same_weights(
    workspace,  # noqa: F811
    tmp_path,
    one_machine_run,
    monkeypatch,
):
    """Both nodes are lost once checkpoint-2 is complete (launchers and workers SIGKILLed); the same two commands
    started again resume from it and end with the weights of an uninterrupted run."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # the paused launchers get `run_env()`, which copies os.environ
    output_dir = tmp_path / "two-machines"
    args = distill_args(workspace, output_dir, **RUN)
    port = free_port()
    commands = [machine(port, rank) + [str(FAULTS_SCRIPT)] + args for rank in (0, 1)]
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with ThreadPoolExecutor(2) as pool:
            launchers = list(
                pool.map(lambda command: start_when_checkpoint_2_exists(command, output_dir, **quiet), commands)
            )
    finally:
        kill_started_processes()
    assert all(launcher.wait(timeout=30) == -signal.SIGKILL for launcher in launchers)
    assert not (output_dir / "model.safetensors").exists()

    result = run_two_machines(args)[0]
    assert f"Resumed from {output_dir / 'checkpoints' / 'checkpoint-2'} at step 2" in result.stderr
    assert_same_final_weights(one_machine_run, output_dir)


@pytest.mark.processes
def test_machines_without_a_shared_output_folder_are_refused_before_the_first_step(workspace, tmp_path):  # noqa: F811
    """Each machine with its own --output_dir (two folders here, as two machines' local disks): process 1's part of
    every checkpoint would land on its own disk, never in the checkpoint the main process completes, and no resume
    could work. The run stops before its first step and says why."""
    local = [tmp_path / f"machine-{rank}-local-disk" for rank in (0, 1)]
    results = run_two_machines(*(distill_args(workspace, folder, **RUN) for folder in local), check=False)
    assert all(result.returncode != 0 for result in results)
    message = f"The checkpoint folder {local[0] / 'checkpoints'} is not one folder shared by all processes"
    assert all(message + ": process 1 on" in result.stderr for result in results)
    assert "every machine mounts at the same path" in results[0].stderr
    assert not (local[0] / "checkpoints" / "checkpoint-2").exists()
