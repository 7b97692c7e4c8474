"""Layer-by-layer calibration: bounded memory, no graph tracing.

The calibration batches run to the first of the model's repeated blocks (``model.model.layers``
and its equivalents) and stop there. Then, for each block, module by module where the modifiers
and the block allow (``sequential.py``: each group of modules collects its statistics on the
outputs of the compressed modules before it, is compressed, and every Linear multiplies once);
otherwise in two passes: a calibration forward lets the modifiers' hooks collect what they need
(Hessians, activation ranges), ``layer_calibrated`` lets them compress the block, and a second
forward with the compressed weights gives the next block's inputs. Only one block's activations are in flight; blocks not reached yet stay where they were
loaded (memory-mapped by ``llmpress.load``), and finished blocks wait as integers
(``quant/compact.py``) until calibration ends. When a modifier watches a module after the
blocks (an lm_head the recipe quantizes, an encoder's head), the model's tail then runs on the
last block's outputs, with stand-ins in the blocks' places. Models without such a list fall back
to whole-model calibration, with a warning.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.memory import release_free_memory
from llmpress.pipelines.basic import run_basic_calibration
from llmpress.pipelines.sequential import (
    BlockPlan,
    NotSequential,
    calibrate_block,
    hand_on,
    kept_bytes,
    plan_block,
)
from llmpress.pipelines.slots import BufferPool
from llmpress.pipelines.tail import TailError, hook_keys, run_tail, watched_tail
from llmpress.quant.compact import CompactWeights
from llmpress.session import Session

__all__ = ["find_layers", "run_layerwise_calibration"]

logger = logging.getLogger(__name__)


class _ReachedFirstLayer(Exception):
    """Raised by a hook to stop the forward pass once the first block's inputs are captured."""


def find_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's repeated blocks: the ModuleList of same-class modules holding the most
    parameters (decoder layers, encoder layers, ``transformer.h``...), or None."""
    best, best_size = None, 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = module, size
    return best


def _capture_first_layer_inputs(model: nn.Module, layer: nn.Module, batches: list[torch.Tensor],
                                device: torch.device, reached: set[int]) -> list[tuple[tuple, dict]]:
    """Each batch's inputs to the first block; ``reached`` gets the ids of the modules run on
    the way there."""
    captured: list[tuple[tuple, dict]] = []

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append((args, kwargs))
        raise _ReachedFirstLayer

    handles = [m.register_forward_pre_hook(lambda m, _: reached.add(id(m))) for m in model.modules()]
    handles.append(layer.register_forward_pre_hook(capture, with_kwargs=True))
    try:
        for batch in batches:
            try:
                model(input_ids=batch.to(device), use_cache=False)
            except _ReachedFirstLayer:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _share_repeated(inputs: list[tuple[tuple, dict]]) -> None:
    """Keyword inputs equal to the first batch's (rotary tables, attention masks: the same for
    every batch of unpadded samples of one length) become that batch's tensor, kept once instead
    of once per batch: for a Llama with head_dim 128 on 2048-token samples, 2 MB a batch of
    rotary tables; a materialised eager-attention mask is 16 MB a batch. The hidden states are
    never shared: each batch's are replaced by the block's output."""
    first: dict[tuple, torch.Tensor] = {}

    def share(path: tuple, value):
        if isinstance(value, torch.Tensor):
            seen = first.setdefault(path, value)
            same = (seen is not value and seen.shape == value.shape and seen.dtype == value.dtype
                    and seen.device == value.device and torch.equal(seen, value))
            return seen if same else value
        if type(value) is tuple:
            return tuple(share((*path, i), item) for i, item in enumerate(value))
        return value

    for index, (args, kwargs) in enumerate(inputs):
        inputs[index] = (args, {k: v if k == "hidden_states" else share((k,), v) for k, v in kwargs.items()})


def _run_layer(layer: nn.Module, inputs: list[tuple[tuple, dict]]) -> tuple | None:
    """Replace each batch's input by the layer's output, one batch at a time (so only one
    batch of the two lists is ever alive twice). Returns what the layer returns besides the
    hidden states (None when it returns them alone), for ``run_tail``."""
    rest = None
    for index, (args, kwargs) in enumerate(inputs):
        rest = hand_on(inputs, index, layer(*args, **kwargs))
    return rest


class _ObservedEnough(Exception):
    """Raised once the last Linear of a block has seen its input: nothing later is observed."""


def _observe_layer(layer: nn.Module, inputs: list[tuple[tuple, dict]]) -> None:
    """The calibration forward: only the inputs of the block's Linear modules matter here, so
    after the first batch each batch stops at the last Linear (its own matmul and everything
    after it are skipped). Blocks whose first batch did not call every Linear exactly once
    (mixture-of-experts routing, say) always run whole."""
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    calls: list[nn.Module] = []
    handles = [m.register_forward_pre_hook(lambda mod, _: calls.append(mod)) for m in linears]
    stop = None
    try:
        for index, (args, kwargs) in enumerate(inputs):
            try:
                layer(*args, **kwargs)
            except _ObservedEnough:
                pass
            if index == 0 and len(calls) == len(linears) and len(set(map(id, calls))) == len(linears):
                stop = calls[-1].register_forward_pre_hook(_stop_forward)  # after the modifiers' hooks
    finally:
        for handle in handles:
            handle.remove()
        if stop is not None:
            stop.remove()


def _stop_forward(module: nn.Module, inputs: tuple) -> None:
    raise _ObservedEnough


def _calibrate_two_pass(layer: nn.Module, index: int, inputs: list[tuple[tuple, dict]], session: Session,
                        outputs_needed: bool) -> tuple | None:
    _observe_layer(layer, inputs)  # the modifiers' hooks collect statistics
    session.layer_calibrated(index, layer)  # ... and compress the layer
    return _run_layer(layer, inputs) if outputs_needed else None  # the compressed layer's outputs


#: automatic ``true_sequential``: module by module while what a block's stages keep is at most
#: this many times the block's own weights (a 1024-hidden Llama on 64 x 256 tokens: 5x; the
#: 5M-parameter test model: 21x, where the kept activations would be a fifth of its peak memory)
KEPT_PER_BLOCK_WEIGHTS = 8


def _signature(layer: nn.Module) -> tuple:
    """Blocks with equal signatures (class, parameter names, shapes and dtypes) plan alike."""
    return (type(layer), tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()))


class _SequentialPlanner:
    """Each block's module-by-module plan, or None (logged) where it takes two passes. A block
    refused for the memory its stages would keep is not probed again for each block like it
    (the probe is a forward of one batch; the answer would be the same)."""

    def __init__(self, automatic: bool) -> None:
        self.automatic = automatic
        self.over_budget: dict[tuple, str] = {}

    def plan(self, layer: nn.Module, index: int, inputs: list[tuple[tuple, dict]]) -> BlockPlan | None:
        signature = _signature(layer) if self.automatic else None
        reason = self.over_budget.get(signature)
        if reason is None:
            try:
                plan = plan_block(layer, inputs[0])
                kept = kept_bytes(plan, inputs)
                budget = KEPT_PER_BLOCK_WEIGHTS * sum(p.numel() * p.element_size() for p in layer.parameters())
                if not (self.automatic and kept > budget):
                    return plan
                reason = (f"it would keep {kept / 2**20:.0f} MB of activations, "
                          f"over {KEPT_PER_BLOCK_WEIGHTS}x the block's weights ({budget / 2**20:.0f} MB)")
                self.over_budget[signature] = reason
            except NotSequential as exc:
                reason = str(exc)
            finally:
                release_free_memory()  # the probe's activations
        logger.info("block %d is calibrated in two passes, not module by module: %s", index, reason)
        return None


@torch.no_grad()
def run_layerwise_calibration(model: nn.Module, session: Session, batches: list[torch.Tensor],
                              true_sequential: bool | None = None) -> None:
    """``true_sequential``: calibrate each block's modules group by group in the order its
    forward calls them, each on the outputs of the compressed ones before it, one forward per
    module (``pipelines/sequential.py``), where the modifiers and the block allow; False: two
    forwards per block; None: module by module while the activations it keeps stay within
    ``KEPT_PER_BLOCK_WEIGHTS`` times the block's weights."""
    if not session.needs_calibration_forward:
        session.calibration_start()
        session.calibration_end()
        return
    layers = find_layers(model)
    if layers is None:
        logger.warning("no repeated blocks found in %s: calibrating the whole model at once", type(model).__name__)
        run_basic_calibration(model, session, batches)
        return
    before = hook_keys(model)
    session.calibration_start()
    device = next(model.parameters()).device
    reached: set[int] = set()
    inputs = _capture_first_layer_inputs(model, layers[0], batches, device, reached)
    _share_repeated(inputs)
    tail = watched_tail(model, layers, reached, before)  # e.g. an lm_head the recipe quantizes
    rest = None
    held = CompactWeights(model)  # finished layers wait as integers: one layer in float at a time
    try:
        bar = tqdm(layers, desc="Calibrating layers", unit="layer")
        planner = _SequentialPlanner(automatic=true_sequential is None)
        pool = BufferPool()  # a module-by-module block's kept activations, reused by the next
        sequential = true_sequential is not False and session.calibrates_by_module
        for index, layer in enumerate(bar):
            outputs_needed = index + 1 < len(layers) or bool(tail)  # they feed what follows
            plan = planner.plan(layer, index, inputs) if sequential else None
            if plan is None:
                pool.clear()  # nothing to reuse them for here
                rest = _calibrate_two_pass(layer, index, inputs, session, outputs_needed)
            else:
                compress = lambda modules, index=index, layer=layer: session.modules_calibrated(index, layer, modules)  # noqa: E731
                rest = calibrate_block(layer, inputs, plan, compress, outputs_needed, pool)
                session.layer_calibrated(index, layer)
            bar.set_postfix_str(session.step_notes(), refresh=False)  # each module's error, e.g. GPTQ's loss
            held.hold(layer)
            release_free_memory()  # the layer's solver temporaries and float weights go back
        pool.clear()
        if tail:
            try:
                run_tail(model, layers, batches, [args[0] for args, _ in inputs], rest, tail, device)
            except TailError as exc:
                logger.warning("could not run %s's modules after its blocks on their outputs (%s): "
                               "they get no calibration data", type(model).__name__, exc)
        inputs.clear()
        release_free_memory()  # the activations go back before the float weights return
    finally:
        held.restore()
    session.calibration_end()
