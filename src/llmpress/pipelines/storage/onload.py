"""Calibrating on a GPU while the model stays in host memory.

The layerwise pipeline moves each block to the execution device for its calibration and back
when it is done. Only one block's weights are there at a time, so a model larger than the GPU
calibrates on it. The block's inputs stay where the pipeline keeps them (memory or spill files).
They cross one batch at a time as the block reads them (``OnDevice``), and its outputs cross
back. Arguments that are the same for every batch (rotary tables, masks: ``share_repeated``)
cross once per block. What the module-by-module stages keep goes to the spill files through
host memory too (``kept.py``), and comes back to the device one batch at a time.

``execution_device(model, None)`` picks the first CUDA GPU when the model is in host memory and
there is one, as llm-compressor does, else the model's own device. Under torch.distributed that
is the rank's own GPU (``init_from_environment`` sets it from ``LOCAL_RANK``), and the
reductions run on NCCL, or on gloo through host memory where ranks share a GPU.

A block may also calibrate in another dtype than it is stored in (``compute_dtype``): a bf16
model on a CPU without bf16 matrix units calibrates each block in float32
(``lifecycle/compute_dtype.py``); the blocks' inputs between blocks stay in the model's dtype.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, MutableSequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmpress import native
from llmpress.contract.block import Inputs, rows_of
from llmpress.contract.observation import primary_input
from llmpress.errors import DataError
from llmpress.lifecycle.compute_dtype import LOW_PRECISION, computing_in
from llmpress.models.classes import model_dtype
from llmpress.parallel.distributed import is_distributed
from llmpress.tensorfiles.dtypes import as_dtype

__all__ = ["OnDevice", "Placement", "compute_dtype", "execution_device", "home_device"]


def home_device(model: nn.Module) -> torch.device:
    """Where the model's weights are (its first parameter's device; the CPU for none)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def execution_device(model: nn.Module, requested: str | torch.device | None) -> torch.device:
    """Where the blocks calibrate: ``requested`` (``"cuda"``, ``"cuda:1"``, ``"cpu"``), or by
    default a CUDA GPU for a model in host memory when there is one, else the model's device."""
    home = home_device(model)
    if requested is None:
        if home.type == "cpu" and torch.cuda.is_available() and torch.cuda.device_count():
            index = torch.cuda.current_device()
            if is_distributed() and "LOCAL_RANK" in os.environ:  # a rank's own GPU, also in a group made without llmpress
                index = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
            return torch.device("cuda", index)
        return home
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as exc:
        raise DataError("unknown calibration device", got=repr(requested), expected="'cpu', 'cuda' or 'cuda:N'") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DataError("calibration on a CUDA device was asked for, but torch sees no CUDA GPU",
                            got=str(device), expected="a CUDA build of torch and a GPU", fix="calibrate with device='cpu'")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise DataError("no such CUDA device", got=str(device), expected=f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        device = torch.device("cuda", index)
    return device


def compute_dtype(stored: torch.dtype, device: torch.device, requested: torch.dtype | str | None = None) -> torch.dtype | None:
    """The dtype a block stored in ``stored`` calibrates in on ``device``, None for its own:
    ``requested`` when given, else float32 for bf16 on a CPU without bf16 units (AVX-512 BF16 or
    AMX, where PyTorch emulates bf16 products) and fp16 on a CPU without AMX-FP16, else its own."""
    wanted = as_dtype(requested)
    if wanted is None and stored in LOW_PRECISION and device.type == "cpu":
        fast = native.bf16_native() if stored == torch.bfloat16 else "amx_fp16" in native.cpu_flags()
        wanted = None if fast else torch.float32
    return None if wanted in (None, stored) else wanted


@dataclass(frozen=True)
class Placement:
    """Where the blocks calibrate (``device``), and where the model and the blocks' inputs stay
    (``home``); the dtype the blocks calibrate in when it is not the one they are stored in
    (``dtype``; ``stored``: the model's)."""

    device: torch.device
    home: torch.device
    dtype: torch.dtype | None = None
    stored: torch.dtype | None = None

    @classmethod
    def of(cls, model: nn.Module, requested: str | torch.device | None = None,
           dtype: torch.dtype | str | None = None) -> Placement:
        device, stored = execution_device(model, requested), model_dtype(model)
        return cls(device, home_device(model), compute_dtype(stored, device, dtype), stored)

    @property
    def moves(self) -> bool:
        """Whether a block's tensors change device or dtype for its calibration."""
        return self.device != self.home or self.dtype is not None

    @contextmanager
    def block(self, module: nn.Module) -> Iterator[None]:
        """``module`` on the device (in the compute dtype) for the length of the ``with`` block,
        then back home (in its own). Its parameters stay the same objects (their data moves), so
        what the modifiers hold of them stays valid."""
        if self.device != self.home:
            module.to(self.device)
        try:
            if self.dtype is None:
                yield
            else:
                with computing_in(module, self.dtype):
                    yield
        finally:
            if self.device != self.home:
                module.to(self.home)

    def inputs(self, inputs: Inputs) -> Inputs:
        """A block's inputs as the block on the device reads them."""
        return OnDevice(inputs, self.device, self.home, self.dtype, self.stored) if self.moves else inputs

    def back(self, value: Any) -> Any:
        """``value`` (tensors in tuples, lists and dicts) at home, in the stored dtype."""
        return _mapped(value, lambda t: _to(t, self.home, self.stored, self.dtype)) if self.moves else value


def _to(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None, only: torch.dtype | None) -> torch.Tensor:
    """``tensor`` on ``device``, and in ``dtype`` when it is in ``only`` (floating tensors of other
    dtypes, integers and masks keep theirs)."""
    return tensor.to(device, dtype) if dtype is not None and tensor.dtype == only else tensor.to(device)


class OnDevice(MutableSequence):
    """A block's inputs (``Inputs``, in memory or spilled) as seen from ``device``: an item read
    comes over, its hidden states and its own other tensors each time, a tensor that several
    batches share (``share_repeated``) once; an item set keeps its hidden states at ``home``.
    With a compute ``dtype``, the tensors in the ``stored`` dtype are read in it and set back in
    ``stored``. Items are read and set one at a time, not added or removed."""

    def __init__(self, inputs: Inputs, device: torch.device, home: torch.device,
                 dtype: torch.dtype | None = None, stored: torch.dtype | None = None) -> None:
        self.inner, self.device, self.home, self.dtype, self.stored = inputs, device, home, dtype, stored
        self._moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (home tensor, its device copy)
        self._back: dict[int, torch.Tensor] = {}  # id of a device copy -> its home tensor
        # the tensors besides the hidden states that more than one batch holds: only these stay
        # on the device for the block (a padded batch's own mask crosses with its batch)
        seen: set[int] = set()
        self._shared: set[int] = set()
        for skeleton in self.skeletons:
            hidden = primary_input(*skeleton)
            mine = {id(t) for t in _tensors(skeleton) if t is not hidden}
            self._shared |= mine & seen
            seen |= mine

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        item = self.inner[index]
        hidden = primary_input(*item)
        return _mapped(item, lambda t: self.hidden_over(t) if t is hidden else self._over(t))

    def hidden_over(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states kept at home (a batch's, or rows of several) as the block reads them:
        on the device, in the compute dtype."""
        return _to(hidden, self.device, self.dtype, self.stored)

    def __setitem__(self, index: Any, item: Any) -> None:
        if not isinstance(index, int):
            raise TypeError("a block's inputs on a device are set one at a time")
        hidden = primary_input(*item)
        self.inner[index] = _mapped(item, lambda t: _to(t, self.home, self.stored, self.dtype) if t is hidden else self._home_of(t))

    def __delitem__(self, index: Any) -> None:
        raise TypeError("a block's inputs are not removed one by one")

    def insert(self, index: int, item: Any) -> None:
        raise TypeError("a block's inputs on a device are not added to")

    @property
    def skeletons(self) -> list[tuple[tuple, dict]]:
        """Each batch's ``(args, kwargs)`` at home, without reading spilled hidden states back."""
        return getattr(self.inner, "skeletons", self.inner)

    def token_rows(self) -> list[int]:
        if hasattr(self.inner, "token_rows"):
            return self.inner.token_rows()
        return [rows_of(primary_input(args, kwargs)) for args, kwargs in self.inner]

    def _over(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device and (self.dtype is None or tensor.dtype != self.stored):
            return tensor
        if id(tensor) not in self._shared:
            return _to(tensor, self.device, self.dtype, self.stored)
        kept = self._moved.get(id(tensor))
        if kept is None or kept[0] is not tensor:
            kept = self._moved[id(tensor)] = (tensor, _to(tensor, self.device, self.dtype, self.stored))
            self._back[id(kept[1])] = tensor
        return kept[1]

    def _home_of(self, tensor: torch.Tensor) -> torch.Tensor:
        home = self._back.get(id(tensor))
        if home is not None and self._moved[id(home)][1] is tensor:
            return home
        return _to(tensor, self.home, self.stored, self.dtype)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value`` (in tuples, lists and dicts too)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif type(value) in (tuple, list):
        for v in value:
            yield from _tensors(v)
    elif type(value) is dict:
        for v in value.values():
            yield from _tensors(v)


def _mapped(value: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with each tensor in it (in tuples, lists and dicts too) passed through ``move``."""
    if isinstance(value, torch.Tensor):
        return move(value)
    if type(value) in (tuple, list):
        return type(value)(_mapped(v, move) for v in value)
    if type(value) is dict:
        return {k: _mapped(v, move) for k, v in value.items()}
    return value
