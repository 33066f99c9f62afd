"""Starting real ranks on this machine: the launch commands the tests, the benchmarks and the
planner's engine calibration share (deepspeed's launcher or Open MPI's mpirun, gloo on the CPU)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

from lazyzero.distributed.mpi_extra import mpirun_executable
from lazyzero.distributed.shm_segments import remove_leftover_segments


def free_port() -> int:
    """A TCP port that is free right now on localhost, for a test's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed_env(threads_per_rank: int = 1) -> dict:
    """Environment for child ranks: one thread each so that two ranks share two cores fairly, and
    Open MPI allowed to run as root (CI runs as root)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads_per_rank), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return env


def launch_command(launcher: str, nprocs: int, argv: list[str], launcher_args: tuple[str, ...] = (),
                   port: int | None = None) -> list[str]:
    """The command line that starts `argv` (a python script and its arguments) on `nprocs` local ranks
    rendezvousing on `port` (default: a free one); `launcher_args` go to the launcher itself (e.g. a
    hostfile)."""
    port = port or free_port()
    if launcher == "deepspeed":
        return ["deepspeed", "--num_gpus", str(nprocs), "--master_port", str(port), *launcher_args, *argv]
    if launcher == "mpirun":
        return [mpirun_executable(), "-n", str(nprocs), "--oversubscribe", "-x", f"MASTER_PORT={port}",
                *launcher_args, sys.executable, *argv]
    raise ValueError(f"launcher: got {launcher!r}; allowed: 'deepspeed', 'mpirun'")


def run_distributed(launcher: str, nprocs: int, argv: list[str], timeout: float = 600, cwd=None,
                    launcher_args: tuple[str, ...] = (), env: dict | None = None):
    """Run `argv` on `nprocs` real ranks and return the CompletedProcess (stdout and stderr merged).
    `env`: variables added to the ranks' environment (e.g. LAZYZERO_FAILPOINT).

    The launcher starts in a session of its own; past `timeout` (or on an interrupt) its whole process
    group is ended, not the launcher alone, so that no rank is left behind, and TimeoutExpired is raised.
    Removes the shared-memory files DeepSpeed's CPU all-reduce leaves behind (`shm_segments.py`),
    which would otherwise fill /dev/shm over a test session."""
    port = free_port()
    cmd = launch_command(launcher, nprocs, argv, launcher_args, port)
    try:
        with subprocess.Popen(cmd, env={**distributed_env(), **(env or {})}, cwd=cwd, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True) as process:
            try:
                output, _ = process.communicate(timeout=timeout)
            except BaseException:
                _end_process_group(process)
                raise
        return subprocess.CompletedProcess(cmd, process.returncode, output)
    finally:
        remove_leftover_segments(port)


def _end_process_group(process, grace_s: float = 10.0) -> None:
    """SIGTERM the launcher's process group, then SIGKILL what is left of it after `grace_s`. The
    deepspeed launcher's ranks are in that group (a stopped one only dies of the SIGKILL); mpirun's
    run in sessions of their own and only mpirun's SIGTERM handler ends them (a SIGKILLed mpirun
    leaves them running), so the launcher gets the grace to do it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.communicate(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.communicate()


def run_deepspeed_nodes(nodes: int, ranks_per_node: int, argv: list[str], timeout: float = 600, cwd=None):
    """Run `argv` as a `nodes` x `ranks_per_node` DeepSpeed job on this machine: one DeepSpeed
    per-node launcher (`deepspeed.launcher.launch`, what the `deepspeed` runner starts on each host
    over ssh) per emulated node, so ranks see the environment a multi-node launch gives them.
    Returns (return code, output): the worst code, and every node's output, node by node."""
    world_info = {f"node{node}": list(range(ranks_per_node)) for node in range(nodes)}
    encoded = base64.urlsafe_b64encode(json.dumps(world_info).encode()).decode()
    port = free_port()
    launchers = [subprocess.Popen(
        [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={encoded}", f"--node_rank={node}",
         "--master_addr=127.0.0.1", f"--master_port={port}", *argv],
        env=distributed_env(), cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for node in range(nodes)]
    outputs, codes = [], []
    try:
        for launcher in launchers:
            outputs.append(launcher.communicate(timeout=timeout)[0])
            codes.append(launcher.returncode)
    except subprocess.TimeoutExpired:
        for launcher in launchers:
            launcher.kill()
        raise
    finally:
        remove_leftover_segments(port)
    return max(codes), "".join(outputs)
