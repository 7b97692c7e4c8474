"""One-shot pruning on calibration data: what ``SparseGPTModifier`` and ``WandaPruningModifier``
share, with llm-compressor's fields and meaning.

Each targeted Linear's inputs are observed while the layerwise pipeline calibrates its block,
and the modules are pruned as soon as their inputs are all seen (``modules_calibrated``), so the
modules after them, and the next blocks, are calibrated on the pruned model's activations.

- ``sparsity``: the fraction of each weight to prune, or a list of one per layer (block).
- ``mask_structure``: ``"0:0"`` (unstructured, the default) or ``"N:M"``, N of every M
  consecutive inputs pruned: ``"2:4"`` is the half-sparse pattern sparse kernels run. The
  structure then sets the sparsity.
- ``sparsity_profile: owl`` with ``owl_m`` and ``owl_lmbda``: outlier-weighted layerwise
  sparsity (Yin et al., 2023). Layers with more outliers of ``|W| * ||x||`` (over ``owl_m`` times
  their mean) get less sparsity, spread over ``2 * owl_lmbda`` around ``sparsity``, the mean
  unchanged: llm-compressor's formula, with each input's norm over all calibration tokens and
  the targeted Linears' scores (llm-compressor sums per-batch norms over every Linear). It costs one forward of the dense model over the
  calibration data first.

The pruned modules are marked with their structure, so the saved checkpoint's ``sparsity_config``
names them (``checkpoint/sparsity.py``).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from pydantic import field_validator, model_validator
from torch import nn

from llmpress.contract.block import find_blocks
from llmpress.contract.modifier import Modifier, ModifierConfig, OneShotFields, State
from llmpress.errors import RecipeError
from llmpress.lifecycle.sparsity import mark_sparse, sparsity_of
from llmpress.models.linear import linear_weight
from llmpress.modifiers.pruning.masks import prunable_modules
from llmpress.parallel.distributed import is_distributed, sum_across_ranks

if TYPE_CHECKING:
    from llmpress.contract.block import CalibrationBlock

__all__ = ["OneShotPruningConfig", "OneShotPruningModifier", "column_squares", "column_squares_over_ranks", "owl_sparsities",
           "parse_pruned_structure"]

logger = logging.getLogger(__name__)

K = TypeVar("K")


def parse_pruned_structure(text: str) -> tuple[int, int] | None:
    """llm-compressor's ``mask_structure``: ``"0:0"`` (or ``"unstructured"``) -> None; ``"2:4"``
    -> (2, 4), N of every M consecutive inputs pruned."""
    if text.strip() in ("0:0", "unstructured"):
        return None
    found = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if not found or not 0 < int(found[1]) < int(found[2]):
        raise RecipeError("mask_structure must be '0:0' (unstructured) or N:M with 0 < N < M (N of every M pruned)",
                          got=repr(text), expected="'0:0', '2:4', '4:8', ...")
    return int(found[1]), int(found[2])


class OneShotPruningConfig(ModifierConfig, OneShotFields):
    sparsity: float | list[float] | None = None
    sparsity_profile: Literal["owl"] | None = None
    owl_m: float | None = None
    owl_lmbda: float | None = None
    mask_structure: str = "0:0"
    targets: list[str] = ["Linear"]
    ignore: list[str] = []
    # accepted so that llm-compressor's recipes run unchanged: llmpress finds the model's blocks
    # itself and always prunes module by module within them
    sequential_targets: str | list[str] | None = None
    sequential_update: bool | None = None
    requires_calibration_data: Literal[True] = True  # in the recipes llm-compressor saves

    @field_validator("targets", mode="before")
    @classmethod
    def _one_target(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("sparsity_profile", mode="before")
    @classmethod
    def _profile(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    def llm_compressor_requires(self) -> dict[str, Any]:
        """``sparsity``, which llm-compressor requires: an N:M structure's own where none is given."""
        structure = parse_pruned_structure(self.mask_structure)
        return {"sparsity": 1 - structure[0] / structure[1] if self.sparsity is None and structure else self.sparsity}

    @model_validator(mode="after")
    def _check(self) -> OneShotPruningConfig:
        name = type(self).__name__.removesuffix("Config")
        structure = parse_pruned_structure(self.mask_structure)
        values = self.sparsity if isinstance(self.sparsity, list) else [self.sparsity]
        if self.sparsity is None and structure is None:
            raise RecipeError(f"{name} needs a sparsity", expected="sparsity: 0.5 (or mask_structure: '2:4')")
        if any(v is not None and not 0.0 <= v < 1.0 for v in values):
            raise RecipeError(f"{name}: sparsity must be in [0, 1)", got=self.sparsity)
        owl = (self.sparsity_profile == "owl", self.owl_m is not None, self.owl_lmbda is not None)
        if any(owl) and not all(owl):
            raise RecipeError(f"{name}: OWL needs sparsity_profile: owl, owl_m and owl_lmbda together",
                              got=f"sparsity_profile={self.sparsity_profile}, owl_m={self.owl_m}, owl_lmbda={self.owl_lmbda}")
        if all(owl) and (structure is not None or isinstance(self.sparsity, list)):
            raise RecipeError(f"{name}: OWL sets each layer's sparsity from one unstructured sparsity",
                              got=f"mask_structure={self.mask_structure}, sparsity={self.sparsity}",
                              fix="give one sparsity and mask_structure: '0:0'")
        return self


class OneShotPruningModifier(Modifier):
    """The shared lifecycle; a subclass gathers what it needs from ``observe`` (``gather``) and
    prunes one module at a time (``prune``)."""

    Config = OneShotPruningConfig
    reduces_across_ranks = True

    def required_state(self) -> tuple[str, ...]:
        return ("model", "calibration_data")

    def on_initialize(self, state: State) -> None:
        self.structure = parse_pruned_structure(self.config.mask_structure)
        keep = None if self.structure is None else (self.structure[1] - self.structure[0], self.structure[1])
        self.modules = prunable_modules(state.model, self.config.targets, self.config.ignore, type(self).__name__, keep)
        self.pending = dict(self.modules)
        heads = [n for n in self.modules if n.split(".")[-1] == "lm_head"]
        if heads:
            logger.warning("%s prunes %s: pruning the output projection costs much accuracy; add 're:.*lm_head' to "
                           "ignore if you did not mean it (llm-compressor no longer leaves it out either)", type(self).__name__, heads[0])
        blocks = find_blocks(state.model)
        self.layer_of = {m: i for i, block in enumerate(blocks or []) for m in block.modules()}
        self.sparsities = self._layer_sparsities(len(blocks or []))
        outside = [n for n, m in self.modules.items() if m not in self.layer_of]
        if outside and (isinstance(self.sparsities, list) or self.config.sparsity_profile == "owl"):
            raise RecipeError(f"{type(self).__name__}: sparsities per layer apply to modules inside the model's layers",
                              got=", ".join(outside[:4]), fix="add them to ignore, or give one sparsity")
        # marked once pruned (or restored pruned): a module left dense, or one another modifier
        # handles before this one prunes it, is not described as sparse
        self.label = "unstructured" if keep is None else f"{keep[0]}:{keep[1]}"
        self.reached: dict[str, float] = {}  # module -> its sparsity once pruned
        if self.config.sparsity_profile == "owl":
            self.sparsities = owl_sparsities(state.model, blocks, self.modules, state.calibration_data, float(self.config.sparsity),
                                             float(self.config.owl_m), float(self.config.owl_lmbda))

    def _layer_sparsities(self, layers: int) -> list[float] | float:
        if self.structure is not None:
            n, m = self.structure
            if self.config.sparsity is not None and self.config.sparsity != n / m:
                logger.warning("%s: mask_structure %d:%d prunes %.3g of each weight; sparsity %s is left aside",
                               type(self).__name__, n, m, n / m, self.config.sparsity)
            return n / m
        if isinstance(self.config.sparsity, list) and len(self.config.sparsity) != layers:
            raise RecipeError(f"{type(self).__name__}: one sparsity per layer, but the model has {layers} layers",
                              got=f"{len(self.config.sparsity)} values", expected=f"{layers} values, or one for all")
        return self.config.sparsity

    def sparsity_for(self, module: nn.Module) -> float:
        if not isinstance(self.sparsities, list):
            return self.sparsities
        return self.sparsities[self.layer_of[module]]  # (modules outside the layers were refused)

    def calibration_targets(self) -> dict[str, nn.Module]:
        return dict(self.pending)

    def observe(self, name: str, x: torch.Tensor) -> None:
        if name in self.pending:
            self.gather(name, x)

    def on_modules_calibrated(self, state: State, block: CalibrationBlock, modules: list[nn.Module]) -> None:
        members = {id(m) for m in modules}
        self._prune_all([n for n, m in self.pending.items() if id(m) in members])

    def on_layer_calibrated(self, state: State, block: CalibrationBlock) -> None:
        self.on_modules_calibrated(state, block, list(block.module.modules()))
        self._note = ""
        done = [n for n, m in self.modules.items() if self.layer_of.get(m) == block.index and n in self.reached]
        if done:
            self._note = f"{type(self).__name__.removesuffix('Modifier')} sparsity {sum(self.reached[n] for n in done) / len(done):.3f}"

    def on_layer_restored(self, state: State, block: CalibrationBlock) -> None:
        inside = {id(m) for m in block.module.modules()}
        for name in [n for n, m in self.pending.items() if id(m) in inside]:
            mark_sparse(self.pending.pop(name), self.label)
            self.forget(name)

    def on_calibration_end(self, state: State) -> None:
        self._prune_all(list(self.pending))
        unreached = list(self.pending)
        if unreached:
            logger.warning("%s: %d module(s) saw no calibration input and were left dense: %s",
                           type(self).__name__, len(unreached), ", ".join(unreached[:8]))
            self.pending.clear()
        if self.reached:
            logger.info("%s: %d modules pruned to %.3f sparsity on average", type(self).__name__, len(self.reached),
                        sum(self.reached.values()) / len(self.reached))

    def step_note(self) -> str:
        return getattr(self, "_note", "")

    @torch.no_grad()
    def _prune_all(self, names: list[str]) -> None:
        for name in self.ready(names):
            module = self.pending.pop(name)
            self.prune(name, module, self.sparsity_for(module))
            mark_sparse(module, self.label)
            self.forget(name)
            self.reached[name] = sparsity_of(module)

    # -- what a subclass gives ---------------------------------------------------------------
    def gather(self, name: str, x: torch.Tensor) -> None:
        raise NotImplementedError

    def ready(self, names: list[str]) -> list[str]:
        """Those of ``names`` that saw input (on any rank: reduced here), in order."""
        raise NotImplementedError

    def prune(self, name: str, module: nn.Module, sparsity: float) -> None:
        raise NotImplementedError

    def forget(self, name: str) -> None:
        """Drop what was gathered for ``name``."""
        raise NotImplementedError


def column_squares(x: torch.Tensor) -> torch.Tensor:
    """Per input channel, the sum of ``x^2`` over every token of ``x`` (float64): what Wanda's
    scores and OWL's outlier ratios take the input norms from."""
    return x.detach().reshape(-1, x.shape[-1]).to(torch.float64).square().sum(0)


@torch.no_grad()
def owl_sparsities(model: nn.Module, blocks: nn.ModuleList | None, modules: dict[str, nn.Module], batches: list[torch.Tensor],
                   sparsity: float, owl_m: float, owl_lmbda: float) -> list[float]:
    """One sparsity per layer from its outlier ratio: the share of ``|W_ij| * ||x_j||`` over
    ``owl_m`` times the layer's mean, the norms taken in one forward of the dense model. The
    ratios, scaled to ``[0, 2 * owl_lmbda]``, lower the sparsity of the layers that have more
    outliers and raise it elsewhere, around the same mean (each clamped to [0, 0.99]). Under
    torch.distributed the norms are summed over the ranks' batches: every rank sets the sparsities
    one process would."""
    if not blocks:
        raise RecipeError("OWL sets one sparsity per layer: no repeated layers found in the model",
                          got=type(model).__name__, fix="give a sparsity without sparsity_profile")
    squares: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple) -> None:
        squares[module] = squares.get(module, 0) + column_squares(args[0])

    inside = set(blocks.modules())
    wanted = {m for m in modules.values() if m in inside}
    handles = [m.register_forward_pre_hook(record) for m in wanted]
    try:
        device = next(model.parameters()).device
        for batch in batches:
            model(input_ids=batch.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if is_distributed():
        squares = column_squares_over_ranks(squares, {m: m for m in modules.values() if m in wanted})
    ratios = []
    for block in blocks:
        scores = [(linear_weight(m.weight, m).detach().abs().float() * squares[m].sqrt().float()).flatten()
                  for m in block.modules() if m in squares]  # [out, in] (a Conv1D's transposed view)
        if not scores:
            ratios.append(0.0)
            continue
        joined = torch.cat(scores)
        ratios.append(float((joined > owl_m * joined.mean()).float().mean()))
    spread = max(ratios) - min(ratios)
    scaled = [(r - min(ratios)) / spread * 2 * owl_lmbda if spread > 0 else 0.0 for r in ratios]
    mean = sum(scaled) / len(scaled)
    result = [sparsity - (s - mean) for s in scaled]
    logger.info("OWL sparsities (outlier ratios %s): %s", ", ".join(f"{r:.4f}" for r in ratios), ", ".join(f"{s:.3f}" for s in result))
    return [min(max(s, 0.0), 0.99) for s in result]


def column_squares_over_ranks(squares: dict[K, torch.Tensor], modules: dict[K, nn.Module]) -> dict[K, torch.Tensor]:
    """``modules``' column squares (``column_squares`` sums, by the same keys) summed over the
    ranks in one all-reduce, zeros where a rank's batches never reached a module (an expert, say);
    a module reached on no rank is left out. Wanda's norms and OWL's outlier ratios read them."""
    if not modules:
        return {}
    keys = list(modules)
    columns = [linear_weight(modules[k].weight, modules[k]).shape[1] for k in keys]
    device = next(iter(squares.values())).device if squares else modules[keys[0]].weight.device
    flat = torch.cat([*(squares.get(k, torch.zeros(c, dtype=torch.float64, device=device)) for k, c in zip(keys, columns)),
                      torch.tensor([float(k in squares) for k in keys], dtype=torch.float64, device=device)])
    sum_across_ranks(flat)
    reached = flat[-len(keys):]
    pieces = flat[:-len(keys)].split(columns)
    return {k: piece for k, piece, seen in zip(keys, pieces, reached) if seen > 0}
