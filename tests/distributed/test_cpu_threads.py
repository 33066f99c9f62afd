"""CPU ranks share the host's cores (lazyzero/distributed/cpu_threads.py), in a fresh process each:
the variables and torch's thread count are per process."""

import os
import subprocess
import sys

import pytest

PROBE = ("import os, torch; from lazyzero.distributed.cpu_threads import share_cpu_cores; "
         "print(share_cpu_cores(), torch.get_num_threads(), os.environ.get('OMP_NUM_THREADS'))")


def probe(**env) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_NUM_THREADS", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize("variable", ["LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"])
def test_a_launchers_ranks_share_the_cores_and_tell_accelerate(variable):
    share = str(max(1, os.cpu_count() // 2))
    assert probe(**{variable: "2"}) == [share, share, share]


def test_more_ranks_than_cores_get_one_thread_each():
    assert probe(LOCAL_SIZE=str(4 * os.cpu_count()))[:2] == ["1", "1"]


def test_omp_num_threads_and_a_process_without_a_launcher_are_left_alone():
    assert probe(LOCAL_SIZE="2", OMP_NUM_THREADS="1")[::2] == ["None", "1"]
    assert probe()[::2] == ["None", "None"]
