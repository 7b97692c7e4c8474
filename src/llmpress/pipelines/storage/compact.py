"""Finished layers' weights held as integers while layer-by-layer calibration goes on.

Once a layer is compressed and has produced the next layer's inputs, its weights are not read
again until calibration ends. A weight on its quantization grid is ``k * scale`` with small
integers ``k``, so it can wait as ``k`` (int8: a quarter of fp32; 4 bits or fewer two to a byte)
and be rebuilt bit for bit at the end (``k * scale`` is the float product that put it on the grid),
or be saved as it is. The full-precision weights of a whole model then never sit in memory with
the calibration state (activations, Hessians, solver temporaries): the peak is one layer in float
plus the rest in integers. Each weight is rebuilt and compared before its float copy is dropped; a
weight that does not come back with equal values (not on its grid yet, an unusual scheme) stays as
it is. (Equal values: a ``-0.0`` comes back as ``0.0``.)
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from llmpress.compat import own_parameters
from llmpress.lifecycle.attach import set_module_buffer
from llmpress.lifecycle.records import keep_held_weights, release_held_weights
from llmpress.lifecycle.state import scheme_of
from llmpress.memory import release_free_memory
from llmpress.quant.packing import bytewise, pack_to_int32, unpack_from_int32
from llmpress.quant.qdq import dequantize, effective_scale, float_copy, grouped

__all__ = ["HELD", "CompactWeights", "mapped_state", "put_tensor"]

HELD = "@held"  # suffix of a weight's key, in a layer file, whose value is the integers held for it


def _rebuild(module: nn.Module, k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``k * scale`` in ``dtype``: the on-grid weight."""
    args = scheme_of(module).weights
    return dequantize(k, module.weight_scale, None, args, dtype, getattr(module, "weight_global_scale", None))


def _grid_values(module: nn.Module) -> torch.Tensor | None:
    """``k`` with ``_rebuild(module, k)`` equal to the module's weight, or None."""
    scheme = scheme_of(module)
    scale = getattr(module, "weight_scale", None)
    weight = getattr(module, "weight", None)
    args = None if scheme is None else scheme.weights
    if args is None or scale is None or not isinstance(weight, nn.Parameter) or weight.device.type != "cpu":
        return None
    if weight.dim() != 2 or args.num_bits > 8:
        return None
    w = weight.detach()
    try:
        view, scale32, _ = grouped(float_copy(w), effective_scale(scale, args, getattr(module, "weight_global_scale", None)), None, args)
        ratio = view.div_(scale32).reshape(w.shape)
        del view
        if args.is_float:
            k = ratio.to(torch.float8_e4m3fn)
        else:
            wide = args.num_bits == 8 and getattr(module, "weight_zero_point", None) is not None
            k = ratio.round_().to(torch.int16 if wide else torch.int8)
        del ratio
        rebuilt = _rebuild(module, k, w.dtype)
    except (RuntimeError, ValueError):  # shapes a scheme expands differently: leave it alone
        return None
    return k if torch.equal(rebuilt, w) else None


def _packed(k: torch.Tensor) -> torch.Tensor:
    """Integers in [-8, 7] two to a byte (the checkpoint's own int4 packing, int32 words) where
    rows fill whole words; others as they are."""
    if k.dtype != torch.int8 or k.dim() != 2 or k.numel() == 0 or not bytewise(4, k.shape[1]):
        return k
    low, high = torch.aminmax(k)  # one pass over the integers, not two
    if int(low) < -8 or int(high) > 7:
        return k
    return pack_to_int32(k, 4)


def _unpacked(stored: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``_packed``'s inverse (int8 of ``shape``)."""
    return unpack_from_int32(stored, 4, shape) if stored.dtype == torch.int32 else stored


def mapped_state(state_file: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A layer file's held integers (by module name) and its other tensors (by key), each
    memory-mapped: from two mappings of the file, so that letting a layer's integers go (the save
    does, module by module) unmaps the pages they were read from, while the scales and norms,
    kept to the end, hold a mapping of their own (one mapping for both kept every page the save
    touched: 1.4 GB of integers resident at the end of the 64-layer 2048-wide Llama)."""
    integers = {key.removesuffix(HELD).rpartition(".")[0]: k
                for key, k in torch.load(state_file, weights_only=True, mmap=True).items() if key.endswith(HELD)}
    rest = {key: t for key, t in torch.load(state_file, weights_only=True, mmap=True).items() if not key.endswith(HELD)}
    return integers, rest


def put_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """``module``'s parameter ``name`` takes ``value`` as its data (the same Parameter object);
    any other name is a buffer set to ``value``."""
    parameter = own_parameters(module).get(name)
    if parameter is not None:
        parameter.data = value
    else:
        set_module_buffer(module, name, value)


def _refuse_while_held(module: nn.Module, inputs: tuple) -> None:
    raise RuntimeError(
        f"{type(module).__name__} is held as integers until layer-by-layer calibration ends; "
        "it cannot run before CompactWeights.restore()"
    )


class CompactWeights:
    """``hold(layer)`` swaps its on-grid weights for integers; ``restore()`` puts every one back
    (same Parameter objects, same values). While held, the module's ``weight`` is a ``meta``
    tensor of the right shape and running the module raises, so an accidental use fails
    loudly instead of computing with nothing."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self._held: list[tuple[nn.Module, nn.Parameter, torch.Tensor, RemovableHandle]] = []
        self._model: nn.Module | None = None  # the model it is attached to (``attach``)
        # a weight that several modules (or a block repeated in the list) share is left alone:
        # holding it would take it away from a module that still runs
        seen = Counter(id(param) for _, param in (model.named_parameters(remove_duplicate=False) if model is not None else ()))
        self._shared = {key for key, count in seen.items() if count > 1}

    @property
    def held_bytes(self) -> int:
        return sum(k.numel() * k.element_size() for _, _, k, _ in self._held)

    def integers(self, module: nn.Module) -> torch.Tensor | None:
        """The integers ``module``'s weight would be held as, or None where it cannot be held."""
        k = None if id(getattr(module, "weight", None)) in self._shared else _grid_values(module)
        return None if k is None else _packed(k)

    def hold(self, layer: nn.Module, rounded: dict[nn.Module, torch.Tensor | None] | None = None) -> int:
        """Hold what can be held in ``layer`` (``rounded``: its ``integers``, found elsewhere);
        returns the bytes of float weight let go."""
        freed = 0
        for module in layer.modules():
            if (k := self.integers(module) if rounded is None else rounded.get(module)) is not None:
                freed += module.weight.numel() * module.weight.element_size()
                self.adopt(module, k)  # the float storage goes back now
        return freed

    def replace_integers(self, module: nn.Module, k: torch.Tensor) -> None:
        """Hold ``module``'s integers as ``k`` from now on: the same values, stored elsewhere (a
        memory-mapped copy of them in a work-folder file, say)."""
        for index, (held, param, old, guard) in enumerate(self._held):
            if held is module:
                if k.shape != old.shape or k.dtype != old.dtype:
                    raise ValueError(f"integers of another shape or dtype: {tuple(k.shape)} {k.dtype}, held {tuple(old.shape)} {old.dtype}")
                self._held[index] = (held, param, k, guard)
                return
        raise KeyError("the module is not held")

    def page_out(self, layer: nn.Module, state_file: Path, adopt: bool = False) -> None:
        """``layer``'s tensors, from now on read memory-mapped from ``state_file`` (a layer file
        the work folder just wrote: its held weights under ``name`` + ``HELD``, the rest under
        their own names): the held integers and everything else the layer keeps (scales, group
        indices, norms) leave the process's memory, so finished layers do not add up in RAM
        however deep the model is (scales alone are 0.7 MB a layer of a 2048-wide Llama at g128).
        ``adopt``: ``layer`` was not held here, and the file's integers are taken as they are (a
        rank whose layer is the one rank 0 held and wrote, bit for bit: it need not round its
        weights again)."""
        modules = dict(layer.named_modules())
        integers, rest = mapped_state(state_file)  # just written: no hash check
        for key, k in integers.items():
            (self.adopt if adopt else self.replace_integers)(modules[key], k)
        for key, mapped in rest.items():
            path, _, name = key.rpartition(".")
            current = getattr(modules[path], name, None)
            if (isinstance(current, torch.Tensor) and current.device.type == "cpu" and id(current) not in self._shared
                    and current.shape == mapped.shape and current.dtype == mapped.dtype):
                put_tensor(modules[path], name, mapped)

    def integers_of(self, layer: nn.Module) -> dict[nn.Module, torch.Tensor]:
        """The held integers (as stored: int4 packed in int32 words) of ``layer``'s modules."""
        inside = set(layer.modules())
        return {module: k for module, _, k, _ in self._held if module in inside}

    def adopt(self, module: nn.Module, k: torch.Tensor) -> None:
        """Hold ``module``'s weight as ``k`` (``integers_of``'s form, saved by an earlier run):
        its float weight goes, and ``restore`` rebuilds it from ``k`` and the module's scales."""
        param: nn.Parameter = module.weight
        guard = module.register_forward_pre_hook(_refuse_while_held)
        self._held.append((module, param, k, guard))
        module.weight = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad)
        param.data = torch.empty(0, dtype=param.dtype)

    def weight_of(self, module: nn.Module, release: bool = True) -> torch.Tensor | None:
        """``module``'s float weight rebuilt from its integers (a new tensor), or None when it is
        not held. After ``attach`` (one save, then the model is let go) the integers go as they are
        handed out (``release`` False: a look before the save), so the checkpoint's tensors take
        their place instead of sitting beside them; the module stays guarded, its weight ``meta``."""
        k = self.grid_values(module, release)
        return None if k is None else _rebuild(module, k, module.weight.dtype)

    def grid_values(self, module: nn.Module, release: bool = True) -> torch.Tensor | None:
        """``module``'s held integers ``k`` unpacked (``k * scale`` is its weight; no zero point), or
        None when it is not held; let go as ``weight_of`` lets its weight go (``release``)."""
        k = next((k for held, _, k, _ in self._held if held is module), None)
        if k is not None and release:
            self.let_go(module)
        return None if k is None else _unpacked(k, module.weight.shape)

    def let_go(self, module: nn.Module) -> None:
        """After ``attach``: ``module``'s integers go, the save has taken them."""
        if self._model is not None:
            self._held = [entry for entry in self._held if entry[0] is not module]

    def attach(self, model: nn.Module) -> None:
        """Keep the held weights past calibration, findable from ``model`` (``held_weights``),
        for one save that writes them and lets them go (``weight_of``)."""
        keep_held_weights(model, self)
        self._model = model

    def release(self, layer: nn.Module) -> None:
        """Rebuild the held weights of ``layer``'s modules, which then run again (a resumed run
        forwarding a finished block); ``hold`` takes them back."""
        inside = set(layer.modules())
        for module, param, k, guard in [entry for entry in self._held if entry[0] in inside]:
            param.data = _rebuild(module, _unpacked(k, module.weight.shape), param.dtype)
            module.weight = param
            guard.remove()
        self._held = [entry for entry in self._held if entry[0] not in inside]

    def restore(self) -> None:
        """Rebuild every held weight. One that cannot be rebuilt (out of memory, say) stays
        held, guarded, with its integers; the others are still restored, then the error raised."""
        failed, error = [], None
        while self._held:
            module, param, k, guard = entry = self._held.pop()
            try:
                rebuilt = _rebuild(module, _unpacked(k, module.weight.shape), param.dtype)  # param keeps its dtype while empty
            except (MemoryError, RuntimeError) as exc:
                failed.append(entry)
                error = error or exc
                continue
            param.data = rebuilt
            module.weight = param
            guard.remove()
            del k, entry
            release_free_memory()  # the integers go back as the floats arrive
        self._held = failed
        if not failed and self._model is not None:
            release_held_weights(self._model, self)
        if error is not None:
            raise error
