"""torch.distributed, as llmpress uses it: which rank this is, the share of the calibration
samples it takes, and the collectives the modifiers reduce their statistics with.

Every helper works unchanged in a single process (it is then the identity, or a no-op), so a
modifier writes its reduction once: ``sum_across_ranks(hessian)`` sums over the ranks under
``torchrun`` and does nothing otherwise. Collectives must be called by every rank in the same
order; the helpers never return early on one rank only.

Backends: gloo on CPU tensors, NCCL on CUDA ones where each rank has a GPU of its own
(``init_from_environment``); a tensor the group's backend does not take crosses through a copy.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from llmpress.errors import DataError, SessionError

__all__ = [
    "alike_on_every_rank",
    "assign_owners",
    "at_group_end",
    "broadcast_object",
    "broadcast_tensor_",
    "end_process_group",
    "gather_objects",
    "gather_objects_on",
    "init_from_environment",
    "is_distributed",
    "is_main_process",
    "max_across_ranks",
    "min_across_ranks",
    "rank",
    "ranks_from_environment",
    "require_reducing_modifiers",
    "same_on_every_rank",
    "share_of",
    "sum_across_ranks",
    "world_size",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return rank() == 0


def init_from_environment(device: torch.device | str | None = None) -> bool:
    """Initialise the default process group from ``torchrun``'s environment (``WORLD_SIZE`` > 1).
    Returns True when it initialised one (the caller destroys it).

    On a machine with CUDA GPUs (unless ``device`` is the CPU) each rank takes GPU ``LOCAL_RANK``
    (modulo their number) and calibrates there. Ranks with a GPU each reduce CUDA tensors on NCCL
    and host ones on gloo (``cpu:gloo,cuda:nccl``); ranks that share a GPU (NCCL refuses two ranks
    on one device) reduce on gloo, through host memory. Without a GPU: gloo."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    wanted = None if device is None else torch.device(device)
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0 and (wanted is None or wanted.type == "cuda")
    backend = "gloo"
    if on_gpu:
        count = torch.cuda.device_count()
        by_local_rank = wanted is None or wanted.index is None  # a named GPU is the user's: every rank on it
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % count if by_local_rank else wanted.index)
        if by_local_rank and int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])) <= count:
            backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend=backend)
    logger.info("rank %d of %d (%s%s)", dist.get_rank(), dist.get_world_size(), backend,
                f", calibrating on cuda:{torch.cuda.current_device()}" if on_gpu else "")
    return True


@contextmanager
def ranks_from_environment(device: torch.device | str | None = None) -> Iterator[bool]:
    """``init_from_environment`` for the length of a ``with`` block, the process group destroyed
    after it (when it made one); yields whether this is the main process."""
    started = init_from_environment(device)
    finished = False
    try:
        yield is_main_process()
        finished = True
    finally:
        if started:
            end_process_group(wait_for_others=finished)


def end_process_group(wait_for_others: bool = True) -> None:
    """Destroy the default process group, after a barrier when ``wait_for_others``: a gloo rank
    that tears its group down while a peer is still finishing the last collective can die at exit
    (SIGABRT, "terminate called without an active exception"), seen about once in a few dozen
    two-rank runs. Pass False on the way out of an error, where the peers may never arrive."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if wait_for_others and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        for callback in _AT_GROUP_END:
            callback()
        dist.destroy_process_group()


_AT_GROUP_END: list[Callable[[], None]] = []


def at_group_end(callback: Callable[[], None]) -> None:
    """Have ``end_process_group`` call ``callback`` before it destroys the group: for what a
    module keeps as long as the group lives (``node.py``'s folder in /dev/shm)."""
    if callback not in _AT_GROUP_END:
        _AT_GROUP_END.append(callback)


def share_of(items: Sequence[T], what: str = "calibration samples") -> list[T]:
    """This rank's share of ``items``: every ``world_size``-th one from its rank (all of them in
    one process). Every rank must get at least one."""
    size = world_size()
    if size == 1:
        return list(items)
    if len(items) < size:
        raise DataError(
            f"{len(items)} {what} cannot be shared by {size} ranks",
            got=f"{len(items)} {what}",
            expected=f"at least one per rank ({size})",
            fix="give more samples (--num-samples) or run fewer ranks",
        )
    return list(items[rank()::size])


def _backend_takes(tensor: torch.Tensor) -> bool:
    """Whether the default group's backend runs collectives on ``tensor``'s device: gloo on host
    tensors, NCCL on CUDA ones, a ``cpu:gloo,cuda:nccl`` group on both."""
    backend = str(dist.get_backend())
    pairs = [part.split(":") for part in backend.split(",")] if ":" in backend else [["cuda" if backend == "nccl" else "cpu", backend]]
    return any(kind == tensor.device.type for kind, _ in pairs)


def _collective(tensor: torch.Tensor, run: Any) -> torch.Tensor:
    """``run`` (a collective, in place) on ``tensor``, through a copy on a device the backend
    takes where it does not take the tensor's own (a CUDA tensor on gloo, when ranks share a GPU)
    or where it is not contiguous; the result copied back."""
    takes = _backend_takes(tensor)
    if takes and tensor.is_contiguous():
        run(tensor)
        return tensor
    device = tensor.device if takes else (
        torch.device("cpu") if tensor.is_cuda else torch.device("cuda", torch.cuda.current_device()))
    staged = tensor.to(device, copy=True, memory_format=torch.contiguous_format)
    run(staged)
    tensor.copy_(staged)
    return tensor


def _reduce(tensor: torch.Tensor, op: Any, dst: int | None) -> torch.Tensor:
    if not is_distributed():
        return tensor
    if dst is None:
        return _collective(tensor, lambda t: dist.all_reduce(t, op=op))
    return _collective(tensor, lambda t: dist.reduce(t, dst=dst, op=op))


def sum_across_ranks(tensor: torch.Tensor, dst: int | None = None) -> torch.Tensor:
    """``tensor`` summed in place over the ranks: on every rank, or only on ``dst`` (the others'
    copies are then undefined)."""
    return _reduce(tensor, dist.ReduceOp.SUM if is_distributed() else None, dst)


def min_across_ranks(tensor: torch.Tensor) -> torch.Tensor:
    return _reduce(tensor, dist.ReduceOp.MIN if is_distributed() else None, None)


def max_across_ranks(tensor: torch.Tensor) -> torch.Tensor:
    return _reduce(tensor, dist.ReduceOp.MAX if is_distributed() else None, None)


def broadcast_tensor_(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """``tensor`` overwritten in place by rank ``src``'s (same shape and dtype on every rank)."""
    if is_distributed():
        _collective(tensor, lambda t: dist.broadcast(t, src=src))
    return tensor


def broadcast_object(value: Any, src: int) -> Any:
    """Rank ``src``'s ``value`` (picklable; small tensors, numbers) on every rank."""
    if not is_distributed():
        return value
    box = [value if rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if not is_distributed():
        return [value]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def gather_objects_on(value: Any, dst: int) -> list[Any] | None:
    """Every rank's ``value``, in rank order, on rank ``dst`` only (None on the others)."""
    if not is_distributed():
        return [value]
    gathered: list[Any] | None = [None] * world_size() if rank() == dst else None
    dist.gather_object(value, gathered, dst=dst)
    return gathered


def alike_on_every_rank(value: Any) -> bool:
    """Whether ``value`` (picklable) is the same on every rank: one all-reduce of its digest,
    where gathering it would pickle it to every rank (True in one process)."""
    if not is_distributed():
        return True
    digest = int.from_bytes(hashlib.blake2b(pickle.dumps(value), digest_size=7).digest(), "little")
    bounds = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(bounds, op=dist.ReduceOp.MIN)
    return int(bounds[0]) == -int(bounds[1])


def same_on_every_rank(value: Any, what: str) -> None:
    """Raise on every rank when ``value`` (picklable) differs between ranks: a collective run
    whose ranks disagree on what they run would otherwise hang or mix results."""
    values = gather_objects(pickle.dumps(value))
    if any(v != values[0] for v in values):
        raise SessionError(f"the ranks disagree on {what}", got="different values on different ranks",
                           expected="the same model, recipe and options on every rank")


def require_reducing_modifiers(modifiers: Sequence[Any]) -> None:
    """On several ranks, refuse a modifier that gathers calibration data without reducing it
    across them (``Modifier.reduces_across_ranks``): each rank would quantize with its own share."""
    if not is_distributed():
        return
    gathering = [type(m).__name__ for m in modifiers
                 if (m.calibration_targets() or "block_start" in m.events or m.runs_blocks()) and not m.reduces_across_ranks]
    if gathering:
        raise SessionError(
            f"{', '.join(gathering)} cannot calibrate on several ranks: it does not reduce what it gathers across them",
            got=f"torch.distributed with {world_size()} ranks",
            expected="modifiers with reduces_across_ranks = True (GPTQ, QuantizationModifier, AWQ, SmoothQuant)",
            fix="run this recipe in one process",
        )


def assign_owners(costs: Sequence[float]) -> list[int]:
    """A rank for each work item, largest first to the least loaded rank (the same answer on
    every rank: it depends only on ``costs``)."""
    size = world_size()
    loads = [(0.0, r) for r in range(size)]
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, owner = heapq.heappop(loads)
        owners[index] = owner
        heapq.heappush(loads, (load + costs[index], owner))
    return owners
