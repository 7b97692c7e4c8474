"""One explicit state per module: what llmpress keeps on a module it compresses.

Every module llmpress touches carries one ``ModuleState`` (``state_of``), and nothing else of
llmpress's: its quantization scheme, where it stands in its quantization (``Status``), its
pruning structure, the handle of its input fake-quantization hook and its KV-cache quantizer.
Its tensors (``weight_scale``, ``input_scale``, ...) stay buffers of the module, where
``state_dict`` finds them.

A module's status moves along::

    (no state) --attach_scheme--> ATTACHED --a session takes it--> PENDING --enable_qat--> TRAINING
                                     |                                |                       |
                                     +------- freeze_weight / GPTQ's solve / freeze_qat ------+--> FROZEN

``COMPRESSED`` is a runtime module holding packed integers (``llmpress.load``). ``FROZEN``
means the weight is on its grid with its qparams stored: what ``train`` keeps fixed in a later
stage that does not quantize it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from llmpress.quant.scheme import QuantizationScheme

__all__ = ["ModuleState", "Status", "existing_state", "forget_state_if_empty", "quantized_modules", "scheme_of", "state_of", "status_of"]

_STATE = "llmpress_state"


class Status(str, Enum):
    #: a scheme is attached; the weight is as it was
    ATTACHED = "attached"
    #: a live session will quantize it (one-shot: at its calibration; training: at its window)
    PENDING = "pending"
    #: quantization-aware training: a fake-quantized forward, the weight trains
    TRAINING = "training"
    #: the weight is on its grid, its qparams stored
    FROZEN = "frozen"
    #: a runtime module holding the compressed (packed) tensors
    COMPRESSED = "compressed"


@dataclass(eq=False)
class ModuleState:
    scheme: QuantizationScheme | None = None
    status: Status | None = None  # None: no scheme
    #: "unstructured" or "N:M" once a pruning modifier (or a sparse checkpoint) pruned it
    sparsity: str | None = None
    #: the forward pre-hook that fake-quantizes the module's input
    input_hook: RemovableHandle | None = None
    #: the attention module's KV-cache quantizer (``kv_cache.py``)
    kv_cache: Any = None

    @property
    def empty(self) -> bool:
        return self.scheme is None and self.sparsity is None and self.input_hook is None and self.kv_cache is None


def state_of(module: nn.Module) -> ModuleState:
    """``module``'s state, made empty on first use."""
    state = module.__dict__.get(_STATE)
    if state is None:
        state = ModuleState()
        module.__dict__[_STATE] = state
    return state


def existing_state(module: nn.Module) -> ModuleState | None:
    """``module``'s state, or None when llmpress never touched it."""
    return module.__dict__.get(_STATE)


def forget_state_if_empty(module: nn.Module) -> None:
    """Drop ``module``'s state once nothing is left in it (a scheme detached, no other mark)."""
    state = existing_state(module)
    if state is not None and state.empty:
        del module.__dict__[_STATE]


def scheme_of(module: nn.Module) -> QuantizationScheme | None:
    """The quantization scheme attached to ``module``, or None."""
    state = existing_state(module)
    return None if state is None else state.scheme


def status_of(module: nn.Module) -> Status | None:
    """Where ``module`` stands in its quantization (None: no scheme)."""
    state = existing_state(module)
    return None if state is None else state.status


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module, QuantizationScheme]]:
    """Every module of ``model`` with a scheme attached, with its name and scheme."""
    return [(name, m, scheme) for name, m in model.named_modules() if (scheme := scheme_of(m)) is not None]
