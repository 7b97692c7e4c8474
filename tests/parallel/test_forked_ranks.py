"""``forked_ranks`` (``llmpress oneshot --ranks N``): the block runs once per rank, in this process
and in processes forked from it; a failing rank is named, and rank 0's failure stops the others.
The blocks here run no torch operator in the forked rank (a forked process must not reuse
threads the parent started)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from helpers import GPTQ_W4_G32, REPO

from llmpress.errors import SessionError
from llmpress.parallel.fork import forked_ranks


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the forked ranks then leave torch's threads alone


def test_the_block_runs_on_every_rank_and_only_rank_zero_goes_on(tmp_path):
    with forked_ranks(3) as rank:
        (tmp_path / f"rank-{rank}").write_text(f"{os.environ['RANK']} {os.environ['WORLD_SIZE']} {os.getpid()}")
        assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    written = {p.name: p.read_text().split() for p in tmp_path.iterdir()}
    assert sorted(written) == ["rank-0", "rank-1", "rank-2"]
    assert [written[f"rank-{r}"][:2] for r in range(3)] == [[str(r), "3"] for r in range(3)]
    assert written["rank-0"][2] == str(os.getpid()) and len({w[2] for w in written.values()}) == 3
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ  # this process's environment as it was


def test_a_failing_forked_rank_is_named(capfd):
    with pytest.raises(SessionError, match="rank 1 exited with status 1: ValueError: only on rank 1"):
        with forked_ranks(2) as rank:
            if rank == 1:
                raise ValueError("only on rank 1")
    assert "Traceback" in capfd.readouterr().err  # the rank's own traceback, on stderr


def test_the_forked_ranks_errors_are_said_once_each_and_not_rank_zeros_again(capfd):
    """Rank 0's error is raised (the command prints it); a forked rank that met the same says
    nothing more, those that met another error say it once for all of them."""
    with pytest.raises(SessionError, match="too few samples") as raised:
        with forked_ranks(4) as rank:
            time.sleep(0.3)  # the forked ranks end first, as they do when every rank checks its input
            if rank in (0, 1):
                raise SessionError("too few samples")
            raise SessionError("no room on this rank")
    err = capfd.readouterr().err
    assert "too few samples" not in err and err.count("no room on this rank") == 1, err
    assert "error (ranks 2, 3): no room on this rank" in err and "rank" not in str(raised.value)


@pytest.mark.parametrize("rank_zero_meets", ["the interruption", "a lost peer"])
def test_ctrl_c_is_an_interruption_not_a_failing_rank(rank_zero_meets):
    """Ctrl-C reaches every rank: rank 0 is interrupted too, or meets the closed connection of a
    rank that was (gloo's error in a collective). Either way the run was interrupted."""
    with pytest.raises(KeyboardInterrupt):
        with forked_ranks(2) as rank:
            if rank == 1:
                raise KeyboardInterrupt
            time.sleep(0.5)  # rank 1 has ended
            if rank_zero_meets == "the interruption":
                raise KeyboardInterrupt
            raise RuntimeError("Connection closed by peer")


def test_rank_zeros_failure_stops_the_other_ranks():
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 0"):
        with forked_ranks(2) as rank:
            if rank == 0:
                raise ValueError("rank 0 gives up")
            time.sleep(60)  # a rank waiting for rank 0 in a collective
    assert time.monotonic() - start < 30


def test_forked_ranks_are_not_started_inside_a_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SessionError, match="already one of a process group"):
        with forked_ranks(2):
            pass


def test_a_fork_that_fails_is_an_error_that_says_so(monkeypatch):
    def no_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    with pytest.raises(SessionError, match="could not fork its ranks"):
        with forked_ranks(2):
            pytest.fail("the block ran without its ranks")
    assert "RANK" not in os.environ


def test_the_command_reports_an_error_every_rank_meets(tmp_path):
    """Too few samples for two ranks: the error as one line from rank 0 (the forked rank's, the
    same, is not said again), no traceback, exit status 2, nothing written."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(GPTQ_W4_G32)
    command = [sys.executable, "-m", "llmpress", "oneshot", "--model", str(REPO / "assets" / "tiny-llama"), "--recipe", str(recipe),
               "--dataset", str(REPO / "assets" / "text" / "calibration.txt"), "--num-samples", "1", "--seq-len", "16",
               "--output", str(tmp_path / "out"), "--ranks", "2"]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.count("1 calibration batches cannot be shared by 2 ranks") == 1, done.stderr[-3000:]  # said once, by rank 0
    assert "error: 1 calibration batches cannot be shared by 2 ranks" in done.stderr and not (tmp_path / "out").exists()


LOSES_A_RANK = """
import torch
from llmpress.errors import SessionError
from llmpress.parallel.distributed import ranks_from_environment, sum_across_ranks
from llmpress.parallel.fork import forked_ranks
try:
    with forked_ranks(2) as rank, ranks_from_environment():
        if rank == 1:
            raise RuntimeError("rank 1 breaks before the collective")
        sum_across_ranks(torch.ones(3))
except SessionError as exc:
    print("rank 0:", exc)
"""


def test_a_rank_lost_in_a_collective_is_named_by_rank_zero():
    """Rank 1 fails while rank 0 waits for it in a gloo collective: rank 0's error (a closed
    connection, from gloo) becomes one that names the rank, whose own error is on stderr."""
    done = subprocess.run([sys.executable, "-c", LOSES_A_RANK], env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                          capture_output=True, text=True, timeout=120)
    assert "rank 0: a forked rank failed" in done.stdout and "rank 1 exited with status 1" in done.stdout, done.stderr[-2000:]
    assert "rank 1 breaks before the collective" in done.stderr


ABANDONS_ITS_RANK = """
import os, sys, time
from llmpress.parallel.fork import forked_ranks
with forked_ranks(2) as rank:
    if rank == 1:
        open(sys.argv[1], "w").write(str(os.getpid()))
        time.sleep(60)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    time.sleep(0.2)
    os._exit(0)  # rank 0's process ends without stopping rank 1
"""


def test_a_forked_rank_ends_with_rank_zeros_process(tmp_path):
    marker = tmp_path / "rank-1.pid"
    subprocess.run([sys.executable, "-c", ABANDONS_ITS_RANK, str(marker)], env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                   timeout=60, check=True)
    pid = int(marker.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
