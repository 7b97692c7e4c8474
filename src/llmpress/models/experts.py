"""Mixture-of-experts layers as one ``nn.Linear`` per expert and projection.

transformers 5 keeps an MoE layer's experts fused: one module holding 3-D parameters
(``gate_up_proj``: experts × 2·intermediate × hidden, ``down_proj``: experts × hidden ×
intermediate), while checkpoints on the Hub, and vLLM, name each expert's projections apart
(``mlp.experts.3.gate_proj.weight``). llmpress turns such a module into ``LinearExperts``: a list
of experts, each with its own ``Linear`` projections, computing exactly what the fused module
computes. In that form every expert is an ordinary ``Linear`` that calibrates (its own Hessian
from the tokens routed to it), quantizes, saves under its per-expert name and runs on the CPU
kernels, with no per-architecture code.

The fused layout is read from the module: transformers' ``use_experts_implementation`` records it
on the instance (``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_gate``), and the
class's ``_apply_gate`` is the activation. The per-expert names are those of transformers'
checkpoint conversion mapping (``w1``/``w3``/``w2`` for Mixtral, ``gate_proj``/``up_proj``/
``down_proj`` elsewhere), so loading and saving need no renaming of experts.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from llmpress.compat import apply_gate, conversion_mapping, converter_patterns, is_converter, own_parameters

__all__ = ["ExpertMLP", "LinearExperts", "calibrating_all_experts", "fused_experts", "linearize_experts", "mixing_all_experts",
           "routed_experts_only"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Layout:
    transposed: bool  # parameters stored input-major (experts × in × out)
    concatenated: bool  # gate and up as halves (else interleaved columns)
    bias: bool
    gate: bool  # a gate projection besides up (else up_proj only)


@dataclass(frozen=True)
class ProjectionNames:
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


def _layout(module: nn.Module) -> _Layout | None:
    """The fused layout as transformers records it; None for an experts class that does not
    (Llama 4's, which also takes its tokens pre-routed): such modules stay fused."""
    fields = {k: getattr(module, k, None) for k in ("is_transposed", "is_concatenated", "has_bias", "has_gate")}
    if None in fields.values() or getattr(module, "has_post_expert_norm", False):
        return None
    return _Layout(fields["is_transposed"], fields["is_concatenated"], fields["has_bias"], fields["has_gate"])


def fused_experts(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The fused experts modules of ``model``: 3-D ``down_proj`` and ``gate_up_proj`` (or ``up_proj``)."""
    for name, module in model.named_modules():
        params = own_parameters(module)
        down = params.get("down_proj")
        up = params.get("gate_up_proj", params.get("up_proj"))
        if down is not None and up is not None and down.dim() == 3 and up.dim() == 3:
            yield name, module


class ExpertMLP(nn.Module):
    """One expert: ``down(gate_fn(gate(x), up(x)))`` with its own Linear projections."""

    def __init__(self, hidden: int, intermediate: int, names: ProjectionNames, *, gate: bool, bias: bool, device, dtype) -> None:
        super().__init__()
        self.names = names
        make = dict(bias=bias, device=device, dtype=dtype)
        if gate:
            setattr(self, names.gate, nn.Linear(hidden, intermediate, **make))
        setattr(self, names.up, nn.Linear(hidden, intermediate, **make))
        setattr(self, names.down, nn.Linear(intermediate, hidden, **make))

    def projections(self) -> tuple[nn.Linear | None, nn.Linear, nn.Linear]:
        return getattr(self, self.names.gate, None), getattr(self, self.names.up), getattr(self, self.names.down)


class LinearExperts(nn.ModuleList):
    """A fused experts module as a list of ``ExpertMLP``; same call, same result.

    ``calibrate_all`` (set by ``calibrating_all_experts``) runs every expert on every token, so
    each expert's projections see the whole calibration set, while the output still mixes only
    the routed experts' results with the router's weights.
    """

    def __init__(self, fused: nn.Module, names: ProjectionNames, layout: _Layout) -> None:
        down = fused.down_proj
        experts, rows, columns = down.shape  # down_proj: hidden × intermediate per expert (transposed: the reverse)
        hidden, intermediate = (columns, rows) if layout.transposed else (rows, columns)
        super().__init__(
            ExpertMLP(hidden, intermediate, names, gate=layout.gate, bias=layout.bias, device=down.device, dtype=down.dtype)
            for _ in range(experts)
        )
        self.layout = layout
        self.calibrate_all = False
        self.mix_all = False  # checking a transform: every expert's result reaches the output
        fused_parameters = own_parameters(fused)
        for name in ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias"):
            if name in fused_parameters:
                if not down.is_meta:
                    self._copy_in(name, fused_parameters[name].detach())
                del fused_parameters[name]
        self._activation = (fused,)  # its _apply_gate (and act_fn, limits); a tuple keeps it out of the state dict

    def _copy_in(self, name: str, value: torch.Tensor) -> None:
        """Split one fused parameter into the experts' Linear weights (or biases)."""
        is_bias = name.endswith("_bias")
        for expert, tensor in zip(self, value):
            gate, up, down = expert.projections()
            if not is_bias and self.layout.transposed:
                tensor = tensor.t()
            attr = "bias" if is_bias else "weight"
            if name.startswith("down_proj"):
                getattr(down, attr).data.copy_(tensor)
            elif gate is None:
                getattr(up, attr).data.copy_(tensor)
            else:
                gate_part, up_part = tensor.chunk(2, dim=0) if self.layout.concatenated else (tensor[0::2], tensor[1::2])
                getattr(gate, attr).data.copy_(gate_part)
                getattr(up, attr).data.copy_(up_part)

    def _expert(self, expert: ExpertMLP, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = expert.projections()
        if gate is None:
            hidden = self._activation[0].act_fn(up(x))
        else:
            g, u = gate(x), up(x)
            joined = torch.cat([g, u], dim=-1) if self.layout.concatenated else torch.stack([g, u], dim=-1).flatten(-2)
            hidden = apply_gate(self._activation[0], joined)
        return down(hidden)

    def forward(self, hidden_states: torch.Tensor, *routing, **named) -> torch.Tensor:
        top_k_index, top_k_weights = (*routing, *named.values())[:2]
        out = torch.zeros_like(hidden_states)
        if self.mix_all:  # an equal share of every expert on every token, whatever the routing
            for expert in self:
                out += self._expert(expert, hidden_states).to(out.dtype) / len(self)
            return out
        for index, expert in enumerate(self):
            token, slot = torch.where(top_k_index == index)
            if self.calibrate_all:
                result = self._expert(expert, hidden_states)[token]
            elif token.numel():
                result = self._expert(expert, hidden_states[token])
            else:
                continue
            out.index_add_(0, token, (result * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"experts={len(self)}, calibrate_all={self.calibrate_all}"


def _projection_names(model: nn.Module) -> dict[str, ProjectionNames]:
    """Per-expert names from transformers' conversion mapping, keyed by the fused parameter's
    name pattern (``mlp.experts``); empty where transformers has none (the defaults apply)."""
    found: dict[str, dict[str, str]] = {}
    # (transformers 4 has no mapping: its experts are already per-expert modules)
    for conversion in conversion_mapping(model, add_legacy=False):
        if not is_converter(conversion):
            continue
        sources, targets = converter_patterns(conversion)
        for target in targets:
            fused = re.match(r"^(.*experts)\.(gate_up_proj|up_proj|down_proj)$", target.lstrip("."))
            if fused is None:
                continue
            names = [re.search(r"experts\.\*\.(\w+)\.weight", s) for s in sources]
            names = [n.group(1) for n in names if n]
            slot = found.setdefault(fused.group(1), {})
            if fused.group(2) == "down_proj" and names:
                slot["down"] = names[0]
            elif fused.group(2) == "gate_up_proj" and len(names) == 2:
                slot["gate"], slot["up"] = names
            elif names:
                slot["up"] = names[0]
    return {pattern: ProjectionNames(**slot) for pattern, slot in found.items()}


def linearize_experts(model: nn.Module, only: list[str] | None = None) -> list[str]:
    """Replace every fused experts module of ``model`` (or those named in ``only``) by
    ``LinearExperts``, in place (on ``meta`` too, for a skeleton about to be loaded). Returns the
    names of the replaced modules; a fused module whose layout cannot be read stays as it is,
    with a warning."""
    names_by_pattern = _projection_names(model)
    replaced, kept = [], []
    for name, module in list(fused_experts(model)):
        if only is not None and name not in only:
            continue
        layout = _layout(module)
        if layout is None:
            kept.append(f"{name} ({type(module).__name__})")
            continue
        names = next((n for p, n in names_by_pattern.items() if name.endswith(p)), ProjectionNames())
        model.set_submodule(name, LinearExperts(module, names, layout))
        replaced.append(name)
    if kept:
        logger.warning(
            "%d fused experts module(s) have a layout llmpress cannot read and stay fused (dense): %s",
            len(kept), ", ".join(kept[:3]),
        )
    if replaced:
        logger.info("%d MoE layer(s) hold their experts as one Linear per expert and projection", len(replaced))
    return replaced


@contextlib.contextmanager
def _all_experts_calibrating(module: nn.Module, value: bool) -> Iterator[None]:
    """Inside, every ``LinearExperts`` of ``module`` has ``calibrate_all = value``; those changed
    get their own value back afterwards."""
    changed = [m for m in module.modules() if isinstance(m, LinearExperts) and m.calibrate_all != value]
    for experts in changed:
        experts.calibrate_all = value
    try:
        yield
    finally:
        for experts in changed:
            experts.calibrate_all = not value


def calibrating_all_experts(model: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within, every expert of ``model`` sees every token (for its statistics); the layers'
    outputs still use only the routed experts."""
    return _all_experts_calibrating(model, True) if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def mixing_all_experts(module: nn.Module) -> Iterator[None]:
    """Within, every ``LinearExperts`` of ``module`` returns the mean of all its experts on every
    token instead of the routed mix: a check that a transform keeps the function then sees every
    expert's weights, not only those the check's batch happens to route to."""
    experts = [m for m in module.modules() if isinstance(m, LinearExperts) and not m.mix_all]
    for m in experts:
        m.mix_all = True
    try:
        yield
    finally:
        for m in experts:
            m.mix_all = False


def routed_experts_only(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Within, the experts of ``module`` see only their routed tokens even while calibrating all:
    for the runs whose outputs feed the next block and nobody observes (a fraction
    ``top_k / experts`` of the work)."""
    return _all_experts_calibrating(module, False)
