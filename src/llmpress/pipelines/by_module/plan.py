"""How a block can be calibrated module by module, learnt from one forward of its first batch.

``plan_block`` runs the block once (nothing observed) with recording hooks on its submodules and
returns a ``BlockPlan``, or the reason the block cannot go module by module (then it takes two
passes). The plan says:

* ``groups``: the block's targets (the modules the modifiers watch, and every Linear) by their
  depth in the block's data flow: a target's depth is one more than the deepest target its input
  was computed from. q/k/v read the normed hidden states (depth 0), o_proj their attention
  (1), gate/up its sum (2), down_proj their product (3); the experts of an MoE layer go as one
  group per depth, not one per expert, and a parallel block's attention and MLP inputs as one.
  The data flow is traced once through autograd (every submodule's output made a leaf; a
  target's input traced back to the leaves it came from). Where it cannot be traced (an
  in-place change of an output, a module computing under ``no_grad``), targets go in call order,
  grouped by shared input. Each group is handed to the modifiers in turn;
* which submodules are called exactly once, in order, and what encloses what;
* ``answers``: a parent whose output is its last target's output (Llama's attention
  returns o_proj's, its MLP down_proj's) can answer from that module's input alone;
* ``zeros``: submodules whose output can be replaced by zeros where it is never used (its shape
  follows from its input: the input's leading dimensions, a fixed number of features);
* ``sources``, ``input_sources`` and ``output_sources`` (traced plans only): who feeds whom
  directly (each submodule's output, each target's input, the block's output), so that a stage
  zeroes exactly what it does not need, including what feeds only stand-ins that never read
  their inputs (Llama's input norm once its attention's output is kept).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmpress.contract.block import Inputs, tokens_per_batch
from llmpress.contract.observation import Observation
from llmpress.models.linear import features, is_linear
from llmpress.pipelines.by_module.probe import Probe
from llmpress.pipelines.stand_ins import ZeroAnswer

logger = logging.getLogger(__name__)

__all__ = ["ParkedAnswer", "BlockPlan", "kept_bytes", "plan_block"]


@dataclass(frozen=True)
class ParkedAnswer:
    """A parent answered from the input of its last target: ``last(x)``, alone
    (``length`` None) or first in a tuple of ``length`` with Nones after."""

    last: nn.Module
    length: int | None


@dataclass
class BlockPlan:
    groups: list[list[nn.Module]]
    order: list[nn.Module]  # submodules called exactly once, in the order they were entered
    ancestors: dict[nn.Module, list[nn.Module]]  # enclosing submodules, innermost first
    targets_in: dict[nn.Module, set[nn.Module]] = field(default_factory=dict)  # module -> the targets in it
    answers: dict[nn.Module, ParkedAnswer] = field(default_factory=dict)
    zeros: dict[nn.Module, tuple[int, int | None, torch.dtype]] = field(default_factory=dict)
    parked_bytes_per_token: int = 0  # the inputs parked for the parents' answers
    sources: dict[nn.Module, set[nn.Module]] | None = None  # submodule -> those its output is computed from, directly
    input_sources: dict[nn.Module, set[nn.Module]] | None = None  # target -> those its input is computed from, directly
    output_sources: set[nn.Module] | None = None  # those the block's output is computed from, directly

    def complete(self, done: set[nn.Module]) -> list[nn.Module]:
        """The outermost submodules whose targets are all in ``done``."""
        full = {m for m in self.order if self.targets_in.get(m) and self.targets_in[m] <= done}
        return [m for m in self.order if m in full and not any(a in full for a in self.ancestors[m])]

    def zeroed_for(self, group: list[nn.Module] | None, answered: set[nn.Module], standing: set[nn.Module] = frozenset(),
                   running: set[nn.Module] = frozenset()) -> dict[nn.Module, ZeroAnswer]:
        """The outermost submodules whose outputs a stage does not need, leaving out the
        ``answered`` ones, those inside them and the group's own. Traced: what the group's inputs
        (None: the block's output) and the ``running`` stand-ins' (which compute and keep their
        outputs) are computed from, not looking behind the ``standing`` stand-ins (which answer
        from what was kept, never reading their inputs), is needed, wherever it was entered.
        Untraced: the submodules entered after the group's last member."""
        members = set(group or ())
        if self.sources is None or (group is None and self.output_sources is None):
            if group is None:
                return {}
            start, needed = self.order.index(group[-1]) + 1, set()
        else:
            start = 0
            seeds = set(self.output_sources or ()) if group is None else set().union(*(self.input_sources.get(m, ()) for m in group))
            needed = self._reached(seeds | set(running), set(standing)) | members | set(running)
            needed |= {a for m in needed for a in self.ancestors.get(m, ())}
        chosen: dict[nn.Module, ZeroAnswer] = {}
        for later in self.order[start:]:
            if (later in self.zeros and later not in needed and later not in members and later not in answered
                    and not any(a in chosen or a in answered for a in self.ancestors[later])):
                chosen[later] = ZeroAnswer(*self.zeros[later])
        return chosen

    def last_needed(self, group: list[nn.Module] | None, answered: list[nn.Module]) -> nn.Module | None:
        """The group's member entered last, where every other stand-in of its stage
        (``answered``) is entered before it: a batch can stop there (None for the outputs stage)."""
        if group is None or any(m not in self.order for m in [*group, *answered]):
            return None
        last = max(group, key=self.order.index)
        return last if all(self.order.index(m) <= self.order.index(last) for m in answered) else None

    def _reached(self, seeds: set[nn.Module], cut: set[nn.Module]) -> set[nn.Module]:
        """``seeds`` and every submodule they are computed from, not looking behind ``cut``."""
        found: set[nn.Module] = set()
        stack = list(seeds)
        while stack:
            module = stack.pop()
            if module in found:
                continue
            found.add(module)
            if module not in cut:
                stack.extend(self.sources.get(module, ()))
        return found

    def moved_to(self, block: nn.Module, names: dict[nn.Module, str]) -> BlockPlan:
        """This plan for another block of the same structure: each module replaced by the one of
        ``block`` at its name (``names``: this plan's block's modules by name)."""
        into = dict(block.named_modules())

        def m(module: nn.Module) -> nn.Module:
            return into[names[module]]

        return BlockPlan(
            groups=[[m(t) for t in group] for group in self.groups],
            order=[m(o) for o in self.order],
            ancestors={m(k): [m(a) for a in chain] for k, chain in self.ancestors.items()},
            targets_in={m(k): {m(t) for t in inside} for k, inside in self.targets_in.items()},
            answers={m(k): ParkedAnswer(m(a.last), a.length) for k, a in self.answers.items()},
            zeros={m(k): shape for k, shape in self.zeros.items()},
            parked_bytes_per_token=self.parked_bytes_per_token,
            sources=None if self.sources is None else {m(k): {m(n) for n in found} for k, found in self.sources.items()},
            input_sources=None if self.input_sources is None else {m(k): {m(n) for n in found}
                                                                   for k, found in self.input_sources.items()},
            output_sources=None if self.output_sources is None else {m(n) for n in self.output_sources},
        )


def kept_bytes(plan: BlockPlan, inputs: Inputs) -> int:
    """About what the stages keep besides the block's inputs: the parked inputs (and, once
    answered, the outputs) of the modules that answer for their parents, for every batch."""
    return plan.parked_bytes_per_token * sum(r for r in tokens_per_batch(inputs) if r > 0)


@torch.no_grad()
def plan_block(block: nn.Module, first: tuple[tuple, dict], targets: list[nn.Module],
               observation: Observation | None = None) -> BlockPlan | str:
    """Probe ``block`` on one batch (``first``: its args and kwargs) and plan the stages for the
    ``targets`` inside it; or say why it cannot go module by module."""
    args, kwargs = first
    record = Probe(block, set(targets), trace=True)
    output_sources = None
    with record, (observation.paused() if observation is not None else nullcontext()):
        output = block(*record.leaves(None, args), **{k: record.leaves(None, v) for k, v in kwargs.items()})
        if isinstance(output, torch.Tensor) or (type(output) is tuple and all(o is None or isinstance(o, torch.Tensor) for o in output)):
            output_sources = record.sources_of(output)  # else (a cache, a dict) the outputs stage zeroes nothing
        del output
    if record.untraced is not None:  # the plain probe: call order
        logger.debug("block %s: data flow not traced (%s); its targets go in call order", type(block).__name__, record.untraced)
        record = Probe(block, set(targets), trace=False)
        with record, (observation.paused() if observation is not None else nullcontext()):
            block(*args, **kwargs)
    if not targets:
        return "it has no module to calibrate"
    counts = sorted({record.calls[m] for m in targets})
    if counts != [1]:
        return f"its modules to calibrate are called {'/'.join(map(str, counts))} times in a forward, not once each"
    tokens = tokens_per_batch([first])[0]
    for module, x in record.target_inputs:
        if not isinstance(x, torch.Tensor) or x.shape[:-1].numel() != tokens:
            return f"{type(module).__name__} sees a subset of the batch's tokens (routed experts?)"
    needs = record.needs()
    plan = BlockPlan(groups=record.groups(needs), order=[m for m in record.order if record.calls[m] == 1],
                     ancestors=_ancestors(block))
    if needs is not None:
        plan.sources, plan.input_sources, plan.output_sources = record.sources(), record.input_sources(), output_sources
    for module in targets:
        for owner in [module, *plan.ancestors[module]]:
            plan.targets_in.setdefault(owner, set()).add(module)
    plan.zeros = {m: shape for m in plan.order if (shape := record.zero_shape(m)) is not None}
    _plan_answers(plan, record)
    plan.parked_bytes_per_token = sum(features(a.last)[0] * a.last.weight.element_size() for a in plan.answers.values())
    return plan


def _plan_answers(plan: BlockPlan, record: Probe) -> None:
    """Parents that return their last target's output as theirs (the outermost such)."""
    rank = {m: i for i, group in enumerate(plan.groups) for m in group}
    for group in plan.groups:
        if len(group) != 1 or not is_linear(group[0]):
            continue
        last = group[0]
        for parent in plan.ancestors[last]:  # innermost first: keep the outermost that qualifies
            answer = _answer_from(last, record.outputs.get(last), record.produced.get(parent))
            if answer is None or record.calls[parent] != 1 or any(rank[m] > rank[last] for m in plan.targets_in[parent]):
                break
            plan.answers = {p: a for p, a in plan.answers.items() if a.last is not last}
            plan.answers[parent] = answer


def _answer_from(last: nn.Module, inner: Any, output: Any) -> ParkedAnswer | None:
    """How a parent's ``output`` carries its module ``last``'s output ``inner``, if it does:
    as itself, or first in a tuple with Nones after."""
    if output is inner:
        return ParkedAnswer(last, None)
    if isinstance(output, tuple) and output and output[0] is inner and all(o is None for o in output[1:]):
        return ParkedAnswer(last, len(output))
    return None


def _ancestors(block: nn.Module) -> dict[nn.Module, list[nn.Module]]:
    parents: dict[nn.Module, nn.Module] = {}
    for parent in block.modules():
        for child in parent.children():
            parents.setdefault(child, parent)
    chains: dict[nn.Module, list[nn.Module]] = {}
    for module in block.modules():
        chain, up = [], parents.get(module)
        while up is not None and up is not block:
            chain.append(up)
            up = parents.get(up)
        chains[module] = chain
    return chains
