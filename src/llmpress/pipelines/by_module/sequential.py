"""One block, module by module ("true sequential"), with every Linear multiplying once.

``reference.py`` calibrates group after group by running the whole block again for each. Here
each stage runs the block once more too, but what it does not need is answered by stand-ins
(``stand_ins.py``) instead of computed:

* a group nobody watches (weight-only RTN needs no data) is handed over without a run;
* the group's own modules hand their input to the modifiers and answer with zeros, and every
  submodule entered after the group's last module answers with zeros: nothing after the group
  is used in this stage;
* a submodule whose targets are all compressed runs once and keeps its output; later
  stages get a copy of that output;
* a submodule that returns its last Linear's output as its own (Llama's attention
  returns o_proj's, its MLP down_proj's) keeps that Linear's input from the stage that observed
  it and answers next stage with that one product.

For a Llama block (groups q/k/v, o, gate/up, down; then the outputs)::

    stage        q/k/v           o_proj          gate/up          down_proj        outputs
    self_attn    q/k/v observed  q/k/v run       o_proj(parked)   kept output      kept output
                 (zeros out),    compressed,     -> kept
                 rest zeros      o_proj observed
                                 + parked
    mlp          zeros           zeros           gate/up          gate/up run,     down_proj(parked)
                                                 observed,        down observed
                                                 rest zeros       + parked

So each Linear multiplies once, compressed (o_proj and down_proj once more, as the parked
product), and what the modifiers see for a group is exactly what the reference gives them. The
price is memory: the attention's output and down_proj's input of every calibration token are
kept for the block (``kept.py``). A stand-in that is not called once per batch, as the probe
saw, stops the run with an error (control flow that changes between batches).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmpress.contract.block import CalibrationBlock, tokens_per_batch
from llmpress.contract.observation import InputsSeen, Observation, primary_input
from llmpress.errors import UnsupportedModelError
from llmpress.lifecycle.kv_cache import KVCacheQuantizer
from llmpress.memory import release_free_memory
from llmpress.models.experts import LinearExperts, routed_experts_only
from llmpress.pipelines.blocks import hand_on
from llmpress.pipelines.by_module.plan import BlockPlan
from llmpress.pipelines.stand_ins import ZeroAnswer, stood_in
from llmpress.pipelines.storage.kept import KeptValues
from llmpress.session import Session

__all__ = ["Kept", "calibrate_block_by_module"]


TRIM_BLOCK_BYTES = 32 << 20  # bench/README.md, "Figures behind the code"


@dataclass
class Kept:
    """What one stage keeps for the next."""

    outputs: dict[nn.Module, KeptValues] = field(default_factory=dict)  # module -> its output, each batch
    parked: dict[nn.Module, KeptValues] = field(default_factory=dict)  # parent -> its last Linear's input, each batch


@torch.no_grad()
def calibrate_block_by_module(block: CalibrationBlock, plan: BlockPlan, session: Session,
                              outputs_needed: bool) -> tuple | None:
    """Calibrate ``block`` group by group as planned; then (when ``outputs_needed``) replace
    each batch's input by the block's output. Returns what the block returns besides its hidden
    states, for the tail pass."""
    observation = session.observation
    rows = tokens_per_batch(block.inputs)
    # large blocks give their heap back between groups (GPTQ on a 2048-wide Llama: 70 MB of
    # peak); small ones do not, the pages faulted back in cost them more than the compute
    trim = sum(p.numel() * p.element_size() for p in block.module.parameters()) >= TRIM_BLOCK_BYTES
    kept = Kept()
    done: set[nn.Module] = set()
    for number, group in enumerate(plan.groups):
        if any(observation.watches(m) for m in group):  # else: nothing to observe, no run
            keep_for_next = number + 1 < len(plan.groups) or outputs_needed
            stage = _Stage(plan, rows, kept, done, observation, group, keep_for_next, block.spill)
            with observation.only(()):  # the group's stand-ins hand their inputs over themselves
                _run(block, stage)
            kept = stage.kept
        session.modules_calibrated(block, group)  # the solver reuses the stage's freed temporaries
        done |= set(group)
        if trim:
            release_free_memory()  # the stage's and the solver's temporaries go back before the next group
    session.layer_calibrated(block)
    if not outputs_needed:
        return None
    if any(KVCacheQuantizer.of(m) is not None for m in block.module.modules()):
        kept = Kept()  # an fp8 KV cache set at layer_calibrated changes what the attention returns: run it again
    last = _Stage(plan, rows, kept, done, observation, spill=block.spill)
    # nobody observes: experts take only their routed tokens, unless a stand-in waits inside them
    routed = routed_experts_only(block.module) if not _inside_experts(last.answers, plan) else nullcontext()
    with observation.paused(), routed:
        return _run(block, last, hand_outputs_on=True)


def _inside_experts(answers: dict[nn.Module, Any], plan: BlockPlan) -> bool:
    return any(isinstance(a, LinearExperts) for m in answers for a in plan.ancestors[m])


def _run(block: CalibrationBlock, stage: _Stage, hand_outputs_on: bool = False) -> tuple | None:
    rest = None
    try:
        with stood_in(block.module, stage.answers):
            for index, (args, kwargs) in enumerate(block.inputs):
                stage.batch = index
                try:
                    output = block.module(*args, **kwargs)
                except InputsSeen:
                    continue
                if hand_outputs_on:
                    rest = hand_on(block.inputs, index, output)
        stage.check(len(block.inputs), type(block.module).__name__)
    finally:
        stage.answers.clear()  # the answers refer to the stage: without them its buffers go back at once
    return rest


class _Stage:
    """One stage's stand-ins (``answers``), from what the last stage kept (``previous``), and
    what it keeps for the next (``kept``, when ``keep_for_next``). ``group``: the modules observed
    in this stage (None: the outputs stage)."""

    def __init__(self, plan: BlockPlan, rows: list[int], previous: Kept, done: set[nn.Module], observation: Observation,
                 group: list[nn.Module] | None = None, keep_for_next: bool = False, spill: Path | None = None) -> None:
        self.plan, self.rows, self.observation, self.batch, self.spill = plan, rows, observation, -1, spill
        self.calls: Counter[nn.Module] = Counter()
        self.answers: dict[nn.Module, Callable[..., Any]] = {}
        self.kept = Kept()
        # the parent that answers next stage from this group's (single) Linear's input
        owner = None
        if group is not None and keep_for_next and len(group) == 1:
            owner = next((p for p, a in plan.answers.items() if a.last is group[0]), None)
        # kept: what is complete now and still outermost once this group is done too (a kept
        # output inside a parent that is complete next stage would only cost memory)
        keep = set() if not keep_for_next else set(plan.complete(done)) & set(plan.complete(done | set(group or ())))
        for module, values in previous.outputs.items():
            self.answers[module] = self._kept_answer(module, values)
            if module in keep:
                self.kept.outputs[module] = values
        for module, values in previous.parked.items():
            self.answers[module] = self._parked_answer(module, values, self._keeper(module, keep))
        standing = set(self.answers)  # answered from what was kept: their inputs are never read
        running = keep - previous.outputs.keys() - previous.parked.keys()
        for module in running:
            self.answers[module] = self._run_answer(module, self._keeper(module, keep))
        if group is not None:  # its modules hand their inputs to the modifiers
            park = None
            if owner is not None:
                park = self.kept.parked[owner] = KeptValues(rows, spill)
            for module in group:
                zeros = ZeroAnswer(*plan.zeros[module]) if module in plan.zeros else None
                self.answers[module] = self._member_answer(module, zeros, park)
        # what nothing in this stage reads answers zeros: what follows the group, and what feeds
        # only the stand-ins that answer from what was kept (Llama's input norm, once its
        # attention's output is kept)
        zeroed = plan.zeroed_for(group, set(self.answers), standing, running)
        # a batch stops at the group's last member where nothing after it keeps a value: the
        # rest (a q/k/v group's attention on zeros) is not computed
        self.stop_after = plan.last_needed(group, [m for m in self.answers if m not in zeroed])
        if self.stop_after is not None:
            last = plan.order.index(self.stop_after)
            zeroed = {m: z for m, z in zeroed.items() if plan.order.index(m) < last}
        self.answers.update(self._zeroed(m, z) for m, z in zeroed.items())

    # -- the stand-ins' answers -------------------------------------------------------------
    def _count(self, module: nn.Module) -> int:
        self.calls[module] += 1
        if self.calls[module] != self.batch + 1:
            raise _control_flow_changed(f"{type(module).__name__} was not called once in a forward of its block, as planned")
        return self.batch

    def _keeper(self, module: nn.Module, keep: set[nn.Module]) -> KeptValues | None:
        if module not in keep:
            return None
        self.kept.outputs[module] = KeptValues(self.rows, self.spill)
        return self.kept.outputs[module]

    def _kept_answer(self, module: nn.Module, values: KeptValues) -> Callable[..., Any]:
        return lambda *args, **kwargs: values.get(self._count(module))

    def _parked_answer(self, module: nn.Module, inputs: KeptValues, store: KeptValues | None) -> Callable[..., Any]:
        answer = self.plan.answers[module]

        def from_parked(*args: Any, **kwargs: Any) -> Any:
            index = self._count(module)
            output = answer.last(inputs.take(index))
            output = output if answer.length is None else (output, *([None] * (answer.length - 1)))
            if store is not None:
                store.put(index, output)
            return output

        return from_parked

    def _run_answer(self, module: nn.Module, store: KeptValues | None) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            index = self._count(module)
            output = module(*args, **kwargs)
            if store is not None:
                store.put(index, output)
            return output

        return run

    def _member_answer(self, module: nn.Module, zeros: ZeroAnswer | None, park: KeptValues | None) -> Callable[..., Any]:
        def observed(*args: Any, **kwargs: Any) -> Any:
            index = self._count(module)
            x = primary_input(args, kwargs)
            self.observation.feed(module, x)
            if park is not None:
                park.put(index, x)
            if module is self.stop_after:
                raise InputsSeen("the stage's last needed input is observed")
            return zeros(x) if zeros is not None else module(*args, **kwargs)

        return observed

    def _zeroed(self, module: nn.Module, zeros: ZeroAnswer) -> tuple[nn.Module, Callable[..., Any]]:
        def zeroed(*args: Any, **kwargs: Any) -> Any:
            self._count(module)
            return zeros(primary_input(args, kwargs))

        return module, zeroed

    def check(self, batches: int, block: str) -> None:
        missed = [m for m in self.answers if self.calls[m] != batches]
        if missed:
            raise _control_flow_changed(
                f"{type(missed[0]).__name__} was not called in every forward of {block}, as planned")


def _control_flow_changed(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        what,
        got="a control flow that differs between batches",
        expected="the same submodules called once in every forward of a block",
        fix="calibrate this model with CalibrationOptions(true_sequential=False)",
    )
