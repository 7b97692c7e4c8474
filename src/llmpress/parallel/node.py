"""Memory that every rank on one machine maps, and work those ranks share out in it.

A stage's Hessian and its factor are the largest things GPTQ holds while it solves (a 2816-wide
``down_proj``: 32 MB each in float32; Llama-8B's 14336-wide one: 820 MB). Ranks that split the
stage's solves by rows all need the same factor; each computing it in its own memory costs N
copies and N times the work. Ranks on one machine (under ``torchrun --nproc-per-node`` or forked
by ``llmpress oneshot --ranks``) instead map one copy, sum their Hessians into it and factor it
together, each its share of the panels (``Team.mine``), meeting at ``Team.sync`` between steps.

The memory is a file in ``/dev/shm`` that every rank maps (``torch.from_file(shared=True)``) and
rank 0 unlinks as soon as all have mapped it: it goes back when the last rank drops its tensor,
and nothing is left behind by a rank that dies. ``node_team()`` is None in one process, where the
ranks are not all on this machine (they do not see the folder rank 0 made), without a writable
``/dev/shm``, or with ``LLMPRESS_NODE_MEMORY=0``; the collectives of ``distributed.py`` then carry
everything, each rank computing the factor itself. Either way the arithmetic is the same panels
in the same order, so the results are the same bits.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from llmpress.errors import SessionError
from llmpress.parallel.distributed import at_group_end, broadcast_object, gather_objects, is_distributed, rank, world_size

__all__ = ["ALONE", "NodeTeam", "Team", "close_node_team", "node_team"]

logger = logging.getLogger(__name__)

_SHARED_FOLDER = Path("/dev/shm")
_SHARED_RESERVE = 64 << 20  # left free in /dev/shm for everything else
_FENCE = threading.Lock()  # taking it is a locked instruction: the stores before it are seen first


class Team:
    """Processes that compute one result together: item ``i`` of a step is computed by the
    process for which ``mine(i)`` is true, and ``sync`` waits until every one has done its items.
    This one is a single process (``ALONE``): every item is its own, nothing to wait for."""

    rank, size = 0, 1

    def mine(self, index: int) -> bool:
        return index % self.size == self.rank

    def sync(self) -> None:
        """Every member's writes before it are seen by every member after it."""

    def decide(self, index: int, value: bool) -> bool:
        """The value that the owner of item ``index`` found (``value`` there), on every member."""
        return value


ALONE = Team()


class NodeTeam(Team):
    """The ranks of this process group, all on this machine, with a folder in ``/dev/shm`` they all see."""

    def __init__(self, folder: Path) -> None:
        self.rank, self.size = rank(), world_size()
        self.folder = folder
        self._made, self._arrived, self._decided, self._said_full = 0, 0, 0, False
        # ``decide``'s answers, written by the item's owner, two in turn (an owner past the next
        # sync may write the next one while a slower rank still reads this one); ``tensors``' answer
        self._flags = self._small((3,), torch.int32)
        pids = self._small((self.size,), torch.int64)
        pids[self.rank] = os.getpid()
        dist.barrier()
        self._pids = pids.tolist()
        # how many syncs each rank has reached: ``sync`` waits on it where the memory order allows
        self._arrivals = self._small((self.size,), torch.int64) if platform.machine().lower() in ("x86_64", "amd64") else None

    def _small(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One of the team's own few bytes, made before its barrier and flags exist."""
        self._made += 1
        path = self.folder / f"{self._made}.bin"
        if self.rank == 0:
            _make_file(path, math.prod(shape) * dtype.itemsize)
        dist.barrier()
        mapped = _mapped(path, shape, dtype)
        dist.barrier()
        if self.rank == 0:
            path.unlink(missing_ok=True)
        return mapped

    def tensors(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
        """Tensors of these ``(shape, dtype)`` (zeros) that every rank maps, or None on every rank
        where ``/dev/shm`` has not the room for them (the caller goes through gloo then; said once:
        a write into a full tmpfs would end the process with SIGBUS). Rank 0 makes the files
        (sparse: a page takes memory once written), the others map them; every rank calls this in
        the same order."""
        paths, sizes = [], []
        for shape, dtype in specs:
            self._made += 1
            paths.append(self.folder / f"{self._made}.bin")
            sizes.append(math.prod(shape) * dtype.itemsize)
        if self.rank == 0:
            free = _free_bytes()
            room = free >= sum(sizes) + _SHARED_RESERVE
            if room:
                for path, size in zip(paths, sizes, strict=True):
                    _make_file(path, size)
            elif not self._said_full:
                logger.warning("%s has %.0f MB free, too little for the ranks' shared buffers (%.0f MB): they go through "
                               "gloo instead (a container's /dev/shm is 64 MB unless --shm-size says more)",
                               _SHARED_FOLDER, free / 2**20, sum(sizes) / 2**20)
                self._said_full = True
            self._flags[2] = int(room)
        self.sync()
        if not bool(self._flags[2]):
            self.sync()  # every rank has read the answer before the next call's
            return None
        mapped = [_mapped(path, shape, dtype) for path, (shape, dtype) in zip(paths, specs, strict=True)]
        self.sync()  # every rank has them mapped: the names can go
        if self.rank == 0:
            for path in paths:
                path.unlink(missing_ok=True)
        return mapped

    def sync(self) -> None:
        """A barrier in the shared memory (gloo's costs 0.2-0.4 ms, and a factor meets hundreds
        of times): each rank counts its arrivals in its own slot and waits until every slot has
        reached its count, polling briefly, then every 0.1 ms, and checking every 0.1 s that the
        ranks it waits for still run. On x86, where a store is seen after the stores before it
        (the lock taken first drains any streaming stores); elsewhere gloo's barrier."""
        if self._arrivals is None:
            dist.barrier()
            return
        with _FENCE:
            self._arrived += 1
        self._arrivals[self.rank] = self._arrived
        polls, checked = 0, time.monotonic()
        while int(self._arrivals.min()) < self._arrived:
            polls += 1
            if polls < 200:
                continue
            time.sleep(1e-4)
            if time.monotonic() - checked > 0.1:
                checked = time.monotonic()
                self._require_running([r for r, n in enumerate(self._arrivals.tolist()) if n < self._arrived])

    def _require_running(self, ranks: list[int]) -> None:
        for rank_ in ranks:
            try:
                state = Path(f"/proc/{self._pids[rank_]}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                state = "X"
            if state in ("Z", "X"):
                raise SessionError(f"rank {rank_} ended while the other ranks waited for it", got=f"process {self._pids[rank_]} gone",
                                   expected="every rank reaching each step", fix="see that rank's error (stderr)")

    def decide(self, index: int, value: bool) -> bool:
        self._decided += 1
        slot = self._decided % 2
        if self.mine(index):
            self._flags[slot] = int(value)
        self.sync()
        return bool(self._flags[slot])


def _make_file(path: Path, size: int) -> None:
    """A sparse file of ``size`` bytes (a page takes memory once written)."""
    with open(path, "wb") as made:
        made.truncate(max(size, 1))


def _mapped(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``path``'s bytes as a tensor every process mapping the file shares."""
    return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)


def _free_bytes() -> int:
    found = os.statvfs(_SHARED_FOLDER)
    return found.f_bavail * found.f_frsize


_TEAMS: dict[int, NodeTeam | None] = {}


def node_team() -> NodeTeam | None:
    """The ranks of the default process group as one ``NodeTeam`` when they share this machine's
    ``/dev/shm``, else None (and None in one process). Collective on its first call in a group:
    every rank calls it at the same point."""
    if not is_distributed():
        return None
    key = id(dist.group.WORLD)
    if key in _TEAMS:
        return _TEAMS[key]
    wanted = os.environ.get("LLMPRESS_NODE_MEMORY", "1") != "0"
    folder = None
    if rank() == 0 and wanted and os.access(_SHARED_FOLDER, os.W_OK):
        folder = tempfile.mkdtemp(prefix="llmpress-ranks-", dir=_SHARED_FOLDER)
        atexit.register(shutil.rmtree, folder, True)  # also where the group is destroyed without end_process_group
    folder = broadcast_object(folder, 0)
    here = None
    if folder is not None and wanted:
        try:
            found = os.stat(folder)
            here = (found.st_dev, found.st_ino)
        except OSError:
            pass
    seen = gather_objects(here)
    team = None
    if folder is not None and all(s is not None and s == seen[0] for s in seen):
        team = NodeTeam(Path(folder))
    elif folder is not None and rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    _TEAMS[key] = team
    return team


def close_node_team() -> None:
    """Forget the default group's team; rank 0 removes its folder (its files are gone already).
    Called as the process group ends."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    team = _TEAMS.pop(id(dist.group.WORLD), None)
    if team is not None and team.rank == 0:
        shutil.rmtree(team.folder, ignore_errors=True)


at_group_end(close_node_team)
