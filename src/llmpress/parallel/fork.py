"""Ranks on one machine forked from one process (``llmpress oneshot --ranks N``), instead of
``torchrun`` starting N interpreters that each import torch and transformers.

The process imports what every rank runs (torch, transformers, the model's classes, llmpress's
modifiers), then forks the other ranks: their interpreters start as copies of it, so the pages
of the imported libraries stay shared (copy-on-write) and host memory for N ranks is about one
process's imports plus N ranks' working memory. The forked ranks join a gloo (or NCCL) group
through ``torchrun``'s variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), so everything
after is the same code as under ``torchrun``. Nothing touches a GPU before the fork (a CUDA
context does not survive one); each rank takes its own after.

This process is rank 0 and waits for the others at the end: a rank that fails ends the run with
an error naming it and saying what the rank met (each forked rank hands its error to rank 0
through a pipe: an error every rank meets, too few samples say, is said once), and the others are
stopped when this one fails.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmpress.errors import LlmpressError, SessionError

__all__ = ["forked_ranks", "import_before_fork"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: the most of a forked rank's error that reaches rank 0 (within a pipe's buffer: the write never waits)
_REPORT_BYTES = 4096
#: a forked rank's exit status after Ctrl-C (the shell's 128 + SIGINT)
_INTERRUPTED = 130
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def import_before_fork(model: str | os.PathLike | None, trust_remote_code: bool = False) -> None:
    """Import what every rank will run, so that the forked ranks share it: llmpress's entry points
    and modifiers and, for a model folder of a transformers architecture, its model class (a
    folder with its own code, or one that cannot be read here, is left to each rank)."""
    importlib.import_module("llmpress.entrypoints")
    importlib.import_module("llmpress.modifiers")
    if model is None or trust_remote_code or not (Path(model) / "config.json").is_file():
        return
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(str(model)))]
    except (KeyError, ValueError, OSError, ImportError):  # the load says what is wrong, on every rank
        logger.debug("%s: its model class is imported by each rank", model)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _become_rank(rank: int, ranks: int, port: int, threads: int | None) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _threads_per_rank(ranks: int) -> int | None:
    """The CPU's cores shared out among the ranks, unless ``OMP_NUM_THREADS`` says otherwise."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // ranks)


@contextmanager
def forked_ranks(ranks: int) -> Iterator[int]:
    """Run the body of the ``with`` block as ``ranks`` ranks of one process group on this machine:
    this process as rank 0, the others forked from it at the ``with``; yields this rank. A forked
    rank ends its process when the block ends (status 0, or 1 on an error, which it prints), so
    only rank 0 goes on after the block. With ``ranks`` 1 the block runs as it is."""
    if ranks <= 1:
        yield 0
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SessionError("--ranks starts its own ranks, and this process is already one of a process group",
                           got=f"--ranks {ranks} under WORLD_SIZE={os.environ['WORLD_SIZE']}",
                           expected="--ranks without torchrun, or torchrun without --ranks", fix="drop one of the two")
    if not hasattr(os, "fork"):
        raise SessionError("--ranks forks its ranks, and this platform cannot fork", got=sys.platform,
                           expected="Linux or macOS", fix="start the ranks with torchrun --nproc-per-node N instead")
    import torch

    port, threads = _free_port(), _threads_per_rank(ranks)
    saved = {name: os.environ.get(name) for name in _RANK_VARIABLES}
    saved_threads = torch.get_num_threads()
    children: dict[int, tuple[int, int]] = {}  # pid -> (rank, the read end of its error's pipe)
    try:
        for rank in range(1, ranks):
            sys.stdout.flush()
            sys.stderr.flush()
            read, write = os.pipe()
            try:
                pid = os.fork()
            except OSError:
                os.close(read)
                os.close(write)
                raise
            if pid == 0:  # the forked rank: the block runs here, then the process ends
                for fd in (read, *(r for _, r in children.values())):  # the pipes rank 0 reads
                    os.close(fd)
                yield from _as_forked_rank(rank, ranks, port, threads, write)
            os.close(write)
            children[pid] = (rank, read)
    except OSError as exc:  # out of processes or memory: the ranks forked so far would wait for the rest
        _reap(children, stop=True, grace_s=0)
        raise SessionError("--ranks could not fork its ranks", got=f"{len(children) + 1} of {ranks}: {exc}",
                           expected="a process per rank", fix="run fewer ranks") from exc
    _become_rank(0, ranks, port, threads)
    try:
        yield 0
    except BaseException as exc:
        failed = _reap(children, stop=True)
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C reaches every rank: an interruption, not a failure
            raise
        if failed and all(code == _INTERRUPTED for _, code, _, _ in failed):  # a rank interrupted while rank 0 waited for it
            raise KeyboardInterrupt from exc
        if failed and not isinstance(exc, LlmpressError):  # a collective that lost its peer, say
            raise _ranks_failed("a forked rank failed, and rank 0 could not go on without it", failed) from exc
        _say_other_errors(failed, str(exc))  # rank 0's own error is said by whoever catches it
        raise
    else:
        failed = _reap(children, stop=False)
        if failed:
            raise _ranks_failed(f"{len(failed)} of the forked ranks failed", failed)
    finally:
        torch.set_num_threads(saved_threads)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _ranks_failed(what: str, failed: list[tuple[int, int, str, str]]) -> SessionError:
    return SessionError(what, got="; ".join(f"{how}: {said}" if said else how for _, _, how, said in failed),
                        expected="every rank finishing", fix="see the rank's error (a traceback is above, on stderr)")


def _say_other_errors(failed: list[tuple[int, int, str, str]], own: str) -> None:
    """On stderr, once per message, the errors of the forked ranks that failed otherwise than rank 0."""
    said: dict[str, list[int]] = {}
    for rank, _, _, message in failed:
        if message and message != own:
            said.setdefault(message, []).append(rank)
    for message, ranks in said.items():
        print(f"error (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}): {message}", file=sys.stderr)


def _as_forked_rank(rank: int, ranks: int, port: int, threads: int | None, report: int) -> Iterator[int]:  # pragma: no cover - a child
    """``forked_ranks`` in a forked rank: the block runs at the ``yield``, then the process ends
    (``os._exit``: the atexit handlers and buffers it was forked with are rank 0's). Its error
    goes to rank 0 through ``report`` (a traceback, for an error that is not llmpress's, to stderr
    as well)."""
    code, message = 1, ""
    try:
        _end_with_parent()
        _become_rank(rank, ranks, port, threads)
        # rank 0 reports: the ranks run the same code on shares of one input, and warn alike
        logging.getLogger().setLevel(max(logging.ERROR, logging.getLogger().level))
        warnings.simplefilter("ignore")
        yield rank
        code = 0
    except LlmpressError as exc:
        message = str(exc)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: rank 0 says it
        code = _INTERRUPTED
    except BaseException as exc:
        print(f"rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        message = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            os.write(report, message.encode()[:_REPORT_BYTES])
        except OSError:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _end_with_parent() -> None:
    """Have the kernel stop this forked rank if rank 0's process dies without stopping it (Linux's
    ``PR_SET_PDEATHSIG``; elsewhere a rank waiting in a collective sees its peer's socket close)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _reap(children: dict[int, tuple[int, int]], stop: bool, grace_s: float = 5.0) -> list[tuple[int, int, str, str]]:
    """Wait for the forked ranks; ``(rank, exit code, how it ended, what it said)`` for each that failed, in
    rank order. With ``stop`` (rank 0 failed, and they may be waiting for it in a collective, or be
    failing themselves: a rank's own error reaches rank 0 as a closed connection before the rank
    has exited) they get ``grace_s`` to end on their own, then are stopped."""
    failed, left = [], dict(children)
    deadline = time.monotonic() + (grace_s if stop else float("inf"))
    while left and time.monotonic() < deadline:
        for pid, (rank, read) in list(left.items()):
            ended, status = os.waitpid(pid, os.WNOHANG if stop else 0)
            if ended:
                del left[pid]
                code = os.waitstatus_to_exitcode(status)
                if code != 0:
                    how = f"rank {rank} exited with status {code}" if code > 0 else f"rank {rank} was killed by signal {-code}"
                    failed.append((rank, code, how, _said(read)))
        if left:
            time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    for _, read in children.values():
        os.close(read)
    return sorted(failed)


def _said(read: int) -> str:
    """What an ended rank wrote into its pipe (without waiting: a process it started may hold the
    pipe open after it)."""
    os.set_blocking(read, False)
    try:
        return os.read(read, _REPORT_BYTES).decode(errors="replace")
    except BlockingIOError:
        return ""
