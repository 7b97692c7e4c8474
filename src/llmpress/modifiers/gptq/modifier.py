"""``GPTQModifier``: GPTQ weight quantization, layer by layer, on calibration data.

Example recipe (llm-compressor's, unchanged)::

    quant_stage:
      quant_modifiers:
        GPTQModifier:
          ignore: [lm_head]
          block_size: 128
          dampening_frac: 0.01
          config_groups:
            group_0:
              targets: [Linear]
              weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}

Hessians of each targeted module's input accumulate from the inputs the session hands to
``observe``; at ``modules_calibrated`` (module by module) or ``layer_calibrated`` the block's
modules are quantized (modules sharing an input and a scheme as one wide matrix) before the
pipeline computes the block's output for the next block. Modules calibration never reached are
rounded to nearest at ``calibration_end`` and reported.
"""

from __future__ import annotations

import logging
import os
import re
import time
import weakref
from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.contract.modifier import MODIFIERS, Modifier, State
from llmpress.errors import SessionError
from llmpress.lifecycle.attach import (
    freeze_weight,
    fused_families,
    scale_dtype_for,
    set_weight_qparams,
    share_global_scales,
)
from llmpress.lifecycle.compute_dtype import stored_dtype
from llmpress.lifecycle.sparsity import sparsity_structure
from llmpress.models.linear import input_major
from llmpress.modifiers.gptq.algorithm import factor_hessian, gptq_quantize
from llmpress.modifiers.gptq.config import GPTQModifierConfig
from llmpress.modifiers.gptq.ranks import RowShare, owners, row_splittable, share_owned
from llmpress.modifiers.hessians import HessianCollector
from llmpress.modifiers.mixed_precision.choose import schemes_at_initialize
from llmpress.modifiers.quantization.activations import InputRangeObserver, has_static_inputs
from llmpress.modifiers.quantization.kv_cache import kv_cache_calibration
from llmpress.modifiers.quantization.modifier import assign_schemes, finish_restored_layer, frozen_by_an_earlier_stage, names_of
from llmpress.parallel.distributed import rank
from llmpress.parallel.node import ALONE, node_team
from llmpress.quant.observers import searched_range, weight_global_scale
from llmpress.quant.scheme import ActivationOrdering, QuantizationScheme

if TYPE_CHECKING:
    from llmpress.contract.block import CalibrationBlock

__all__ = ["GPTQModifier"]

logger = logging.getLogger(__name__)


#: the weight strategies whose columns GPTQ takes in activation order by default (llm-compressor's list)
ORDERED_STRATEGIES = ("group", "tensor_group", "channel", "tensor", "block")


def _with_gptq_defaults(scheme: QuantizationScheme, actorder: ActivationOrdering | None) -> QuantizationScheme:
    """The scheme GPTQ applies. Where it names no column order, the modifier's ``actorder``
    (by default ``static``, as in llm-compressor 0.14): the saved config says what was done, and
    a recipe without ``actorder`` means the same in both tools (``actorder: null`` on the
    modifier: left to right).
    Static order fixes each group's scale before the update and stores nothing more; on the
    trained test model in bf16 it takes the quantized model's KL divergence from the
    unquantized one from 0.00187 to 0.00162 (bench/README.md, "Real checkpoints").

    A squared-error range search is the default observer when the recipe names none: it beats
    min/max clearly at 3-4 bits (on the trained test model, 3-bit perplexity 63.95 instead of
    64.18). Not for int8 weights, which keep min/max (llm-compressor's default): on a grid that
    fine clipping buys nothing, and on the test model min/max gave the lower perplexity with int8
    inputs (W8A8 63.673 against 63.679; SmoothQuant + W8A8 63.677 against 63.679) and the same
    without (W8A16 63.672 against 63.671)."""
    weights = scheme.weights
    if weights is None:
        return scheme
    if weights.actorder is None and actorder is not None and weights.strategy in ORDERED_STRATEGIES:
        weights = weights.model_copy(update={"actorder": actorder})
    weights = searched_range(weights)
    return scheme if weights is scheme.weights else scheme.model_copy(update={"weights": weights})


def _labels(names: list[str]) -> dict[str, str]:
    """Short labels for a layer's modules: ``model.layers.3.self_attn.q_proj`` -> ``q``; where
    short names collide (BERT's ``dense``, per-expert Linears) the path inside the layer."""
    parts = [n.split(".") for n in names]
    shared = len(os.path.commonprefix(parts)) if len(parts) > 1 else len(parts[0]) - 1
    inner = [".".join(p[min(shared, len(p) - 1):]) for p in parts]
    short = [p[-1].removesuffix("_proj") or p[-1] for p in parts]
    counts = Counter(short)
    return {n: s if counts[s] == 1 else i for n, s, i in zip(names, short, inner)}


@MODIFIERS.register("GPTQModifier")
class GPTQModifier(Modifier):
    Config = GPTQModifierConfig
    reduces_across_ranks = True  # Hessians summed onto the rank that solves; ranges and KV-cache magnitudes reduced

    def required_state(self) -> tuple[str, ...]:
        return ("model", "calibration_data")

    def on_initialize(self, state: State) -> None:
        chosen = schemes_at_initialize(self.config, state, type(self).__name__, self._rounding)
        self._last_factor = None
        schemes = [_with_gptq_defaults(s, self.config.actorder) for s in chosen]
        self.modules = assign_schemes(state.model, schemes, self.config.ignore, type(self).__name__)
        kept = frozen_by_an_earlier_stage(self.modules)
        self.pending = {name: entry for name, entry in self.modules.items() if name not in kept}
        self.families = fused_families(state.model)  # NVFP4: q/k/v, gate/up share a global scale
        self.kv_cache = kv_cache_calibration(state.model, self.config, type(self).__name__)
        self.hessians = HessianCollector(offload=self.config.offload_hessians)
        self.inputs = InputRangeObserver(type(self).__name__)
        self.losses: dict[str, float] = {}
        self._note = ""  # the last layer's losses, for the progress bar
        self.seconds = 0.0

    def _rounding(self, weight: torch.Tensor, hessian: torch.Tensor, scheme: QuantizationScheme) -> torch.Tensor:
        """``weight`` as this modifier would round it under ``scheme`` given ``hessian``: how a
        mixed-precision choice weighs each scheme (``modifiers/mixed_precision``)."""
        args = _with_gptq_defaults(scheme, self.config.actorder).weights
        ordered = args.actorder is not None
        # a module's menu options (and q/k/v's) come in a row: one factor, kept as long as its
        # Hessian lives (the next layer's Hessians are summed after this one's are freed)
        cached = getattr(self, "_last_factor", None)
        if cached is None or cached[0]() is not hessian or cached[1] != ordered:
            self._last_factor = cached = (weakref.ref(hessian), ordered, factor_hessian(hessian, self.config.dampening_frac, ordered))
            weakref.finalize(hessian, self._forget_factor, cached)
        factor = cached[2]
        global_scale = weight_global_scale([weight]).reshape(1).expand(weight.shape[0]) if args.has_global_scale else None
        return gptq_quantize(weight, factor, args, block_size=self.config.block_size, global_scale=global_scale).weight

    def _forget_factor(self, cached: tuple) -> None:
        if getattr(self, "_last_factor", None) is cached:
            self._last_factor = None

    def calibration_targets(self) -> dict[str, nn.Module]:
        return {n: m for n, (m, s) in self.pending.items() if s.weights is not None or has_static_inputs(s)}

    def runs_blocks(self) -> bool:
        kv_cache = getattr(self, "kv_cache", None)
        return kv_cache is not None and bool(kv_cache.pending)

    def observe(self, name: str, x: torch.Tensor) -> None:
        if name not in self.pending:  # quantized already: its inputs no longer matter
            return
        scheme = self.pending[name][1]
        if scheme.weights is not None:
            self.hessians.add(name, x)
        if has_static_inputs(scheme):
            self.inputs.record(name, x)

    def scales_inputs(self, name: str) -> bool:
        entry = self.pending.get(name)
        return entry is not None and not has_static_inputs(entry[1])  # a Hessian rescales; a range does not

    def scale_inputs(self, names: list[str], factor: torch.Tensor) -> None:
        self.hessians.scale_inputs([n for n in names if n in self.pending], factor)

    def on_modules_calibrated(self, state: State, block: CalibrationBlock, modules: list[nn.Module]) -> None:
        self.quantize(names_of(modules, self.pending), f"layer {block.index}")

    def on_layer_calibrated(self, state: State, block: CalibrationBlock) -> None:
        self.quantize(names_of(block.module.modules(), self.pending), f"layer {block.index}")
        if self.kv_cache is not None:
            self.kv_cache.layer_calibrated(block)
        done = [n for n in names_of(block.module.modules(), self.modules) if n in self.losses]
        self._note = ""
        if done:
            # an MoE layer's experts: one figure per projection (the largest loss among experts)
            losses: dict[str, float] = {}
            for n in done:
                key = re.sub(r"\.experts\.\d+\.", ".experts.", n)
                losses[key] = max(losses.get(key, 0.0), self.losses[n])
            labels = _labels(list(losses))
            self._note = "GPTQ loss " + " ".join(f"{labels[n]} {loss:.3g}" for n, loss in losses.items())
            logger.info("%s layer %d: %s", type(self).__name__, block.index, self._note)

    def on_layer_restored(self, state: State, block: CalibrationBlock) -> None:
        finish_restored_layer(block, self.pending, self.kv_cache)

    def step_note(self) -> str:
        return self._note

    def on_calibration_end(self, state: State) -> None:
        if self.kv_cache is not None:
            self.kv_cache.calibration_end()
        self.hessians.agree(list(self.pending), self._device)  # reached on any rank is reached
        reached = [n for n in self.pending if n in self.hessians.of_module]
        self.quantize(reached, "rest")
        unreached = list(self.pending)
        if unreached:
            logger.warning(
                "%s: %d module(s) saw no calibration input and were rounded to nearest instead: %s",
                type(self).__name__, len(unreached), ", ".join(unreached[:8]),
            )
            share_global_scales([self.pending[n][0] for n in unreached], self.families)
            self.inputs.reduce([n for n in unreached if has_static_inputs(self.pending[n][1])])
            for name in unreached:
                module, scheme = self.pending.pop(name)
                self.hessians.release([name])
                if scheme.weights is not None:
                    freeze_weight(module)
                self.inputs.apply_input_quantization(name, module, scheme)
        if self.losses:
            logger.info("%s: %d modules in %.1fs, total GPTQ loss %.4g", type(self).__name__, len(self.losses), self.seconds, sum(self.losses.values()))

    def on_finalize(self, state: State) -> None:
        if self.pending:
            raise SessionError(
                f"{type(self).__name__} cannot finalize: {len(self.pending)} module(s) were never calibrated",
                got="finalize() without calibration_start() / calibration_end()",
                expected="calibration events with forward passes over calibration_data",
                fix="use llmpress.oneshot(...), or send calibration_start(), run the calibration batches "
                "through the model, then calibration_end()",
            )

    # -- the work ------------------------------------------------------------------------------
    def quantize(self, names: list[str], where: str) -> None:
        """GPTQ on ``names``; modules that share a Hessian and a scheme go as one matrix.

        Under torch.distributed (every rank calls this with the same ``names``) each Hessian is
        summed over the ranks; a group with row-wise qparams is solved by every rank on its share
        of the rows, any other by one rank (balanced by the solves' cost); every result then goes
        to every rank (``ranks.py``)."""
        self.hessians.end_of_first_pass()
        # NVFP4: global scales from the weights as they are, fixed before any solve changes them
        share_global_scales([self.pending[n][0] for n in names if n in self.pending], self.families)
        self.hessians.agree([n for n in names if n in self.pending], self._device_of(names))
        groups: dict[tuple[int, str, bool], list[str]] = {}
        for name in names:
            accumulator = self.hessians.of_module.get(name)
            _, scheme = self.pending[name]
            if accumulator is None or scheme.weights is None:
                continue
            key = (id(accumulator), scheme.weights.model_dump_json(), input_major(self.pending[name][0]))
            groups.setdefault(key, []).append(name)
        split = {key for key, members in groups.items()
                 if row_splittable(self.pending[members[0]][1].weights.strategy, self.pending[members[0]][0])}
        owner = owners(groups, self.pending, split)
        # each Hessian summed once, onto the rank that solves with it, or onto every rank when
        # its groups are split by rows or solved by different ranks (mixed schemes on q, k, v)
        targets: dict[int, tuple] = {}
        for key, members in groups.items():
            if owner[key] is not None or key in split:
                _, before = targets.get(key[0], (None, owner[key]))
                targets[key[0]] = (self.hessians.of_module[members[0]], owner[key] if before == owner[key] else None)
        node = node_team() if targets else None  # ranks on one machine sum and factor in memory they share
        for accumulator, target in targets.values():
            accumulator.reduce(target, node=node if target is None else None)
        mine = [(key, members) for key, members in groups.items() if owner[key] in (None, rank())]
        shares = {key: RowShare([self.pending[n][0] for n in members], members) for key, members in mine if key in split}
        bar = tqdm(mine, desc=f"GPTQ {where}", leave=False, disable=True if len(mine) < 2 else None)
        for key, members in bar:
            self._quantize_group(members, shares.get(key))
            if key not in shares:
                bar.set_postfix_str(", ".join(f"{n.rsplit('.', 1)[-1]} {self.losses[n]:.3g}" for n in members))
        for key, members in groups.items():  # the results onto every rank, in the same order on each
            if key in shares:
                shares[key].gather(self.losses, node)
            elif owner[key] is not None:
                share_owned([self.pending[n][0] for n in members], members, owner[key], self.losses)
        self.inputs.reduce([n for n in names if n in self.pending and has_static_inputs(self.pending[n][1])])
        for name in names:  # a module that saw no input stays pending: calibration_end rounds it and says so
            if name in self.pending and (name in self.losses or self.pending[name][1].weights is None):
                module, scheme = self.pending.pop(name)
                self.inputs.apply_input_quantization(name, module, scheme)
        self.hessians.release([n for n in names if n not in self.pending])

    def _device_of(self, names: list[str]) -> torch.device:
        """Where this call's Hessians go: the device of one of ``names`` still waiting for its
        solve (the block's, on a GPU where it calibrates there), else ``_device``'s."""
        waiting = (self.pending[n][0].weight.device for n in names if n in self.pending)
        return next((d for d in waiting if d.type != "meta"), self._device)

    @property
    def _device(self) -> torch.device:
        """Where this block's Hessians go: the device of a module still waiting for its solve
        (a finished layer's weight is held as integers, its Parameter left on ``meta``)."""
        waiting = (module.weight.device for module, _ in self.pending.values())
        return next((d for d in waiting if d.type != "meta"), torch.device("cpu"))

    def _quantize_group(self, names: list[str], share: RowShare | None = None) -> None:
        """GPTQ on modules that share a Hessian and a scheme: all their rows, or ``share``'s rows
        of this rank (the results wait in ``share`` for the other ranks')."""
        start = time.perf_counter()
        modules = [self.pending[n][0] for n in names]
        scheme: QuantizationScheme = self.pending[names[0]][1]
        args = scheme.weights
        accumulator = self.hessians.of_module[names[0]]
        shared = any(a is accumulator for n, a in self.hessians.of_module.items() if n not in names)
        hessian = accumulator.result().to(modules[0].weight.device)  # offloaded Hessians come back for the solve
        team, overwrite = ALONE, not shared
        if accumulator.node is not None:  # in memory the ranks share: factored there by all, or here by each
            if share is not None and not shared and hessian.shape[0] >= TEAM_FACTOR_COLUMNS:  # every rank is here
                team = accumulator.node
            else:
                hessian, overwrite = hessian.clone(), True
        factor = factor_hessian(hessian, self.config.dampening_frac, args.actorder is not None, overwrite=overwrite, team=team)
        if not shared:  # the factor took the Hessian's memory: this group was its last user
            self.hessians.release(names)
        # row-wise qparams (channel, group) let modules sharing a Hessian quantize as one matrix;
        # an input-major weight's (Conv1D's) qparams run along its columns: it goes alone
        transposed = input_major(modules[0])
        fuse = args.strategy in ("channel", "group", "tensor_group") and not transposed
        pieces = share.pieces() if share is not None else [(m, 0, m.weight.shape[0]) for m in modules]
        marked = any(sparsity_structure(m) for m in modules)  # masks for every batch or none, however batched
        for batch in _row_batches(pieces, FUSED_ELEMENTS if fuse else 0):
            weight = [m.weight.data[a:b] for m, a, b in batch]
            global_scale = None
            if args.has_global_scale:  # one per row of the stacked matrix
                global_scale = torch.cat([m.weight_global_scale.reshape(1).expand(b - a) for m, a, b in batch])
            result = gptq_quantize(weight, factor, args, block_size=self.config.block_size,
                                   scale_dtype=scale_dtype_for(args, stored_dtype(batch[0][0])),
                                   input_major=transposed, global_scale=global_scale, keep=_kept(batch) if marked else None)
            del weight
            if len(batch) == 1 and share is None:  # the whole result is the module's, in its own layout
                set_weight_qparams(batch[0][0], result.weight, result.scale, result.zero_point)
                self.losses[names[modules.index(batch[0][0])]] = result.loss
                del result
                continue
            offset = 0
            for module, a, b in batch:  # each module's rows of the stacked result
                part = slice(offset, offset + b - a)
                zp = None if result.zero_point is None else result.zero_point[part]
                scale = result.scale if result.scale.numel() == 1 else result.scale[part]
                loss = float(result.row_loss[part].sum())
                if share is not None:
                    share.take(module, a, b, result.weight[part], scale, zp, loss)
                else:
                    set_weight_qparams(module, result.weight[part], scale, zp)
                    self.losses[names[modules.index(module)]] = loss
                offset = part.stop
            del result
        self.seconds += time.perf_counter() - start


def _kept(pieces: list[tuple[nn.Module, int, int]]) -> list[torch.Tensor]:
    """The nonzero pattern of the rows ``[a, b)`` of each module a pruning modifier marked (or a
    sparse checkpoint named), all ones for the others: GPTQ keeps the zeros."""
    return [m.weight.data[a:b] != 0 if sparsity_structure(m) else torch.ones_like(m.weight.data[a:b], dtype=torch.bool)
            for m, a, b in pieces]


#: ranks sharing a Hessian in memory factor it together from this many columns, each rank a
#: smaller one itself (two ranks of this machine: 512 columns, 5 ms either way; 1024: 13 ms
#: together, 18 alone; 2816: 131 against 216)
TEAM_FACTOR_COLUMNS = 1024

#: modules sharing a Hessian are solved as one stacked matrix of at most this many weights
#: (256 MB in float32), one factor for all: an MoE layer's 2 x 128 expert projections go in a
#: few batches, not as one copy of the layer
FUSED_ELEMENTS = 1 << 26


def _row_batches(pieces: list[tuple[nn.Module, int, int]], bound: int) -> list[list[tuple[nn.Module, int, int]]]:
    """``pieces`` (a module's rows ``[a, b)``) in order, in batches of at most ``bound`` weights
    (a larger piece alone)."""
    batches: list[list[tuple[nn.Module, int, int]]] = []
    size = 0
    for piece in pieces:
        module, a, b = piece
        count = (b - a) * module.weight[0].numel()
        if batches and size + count <= bound:
            batches[-1].append(piece)
            size += count
        else:
            batches.append([piece])
            size = count
    return batches
