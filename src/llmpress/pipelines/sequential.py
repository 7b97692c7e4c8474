"""One block, module by module ("true sequential"): every Linear multiplies once, compressed.

The two-pass scheme runs a block twice: with float weights so the modifiers see each module's
inputs, then with the compressed weights for the next block's inputs. Here the block's Linear
modules are taken in the order its forward calls them, grouped by shared input (q/k/v read the
same normed hidden states, as do gate/up). Stage by stage, a group's inputs are collected with
everything before it already compressed, then the group is compressed
(``session.modules_calibrated``); a last stage gives the block's outputs. What the modifiers see
for a group is exactly what the compressed model gives it, as in the GPTQ paper's
"true-sequential" order, and nothing is computed twice:

* a submodule whose Linear modules are all compressed (the attention once o_proj is) answers
  later stages from the output it gave when it last ran, instead of running again;
* a submodule that returns its last Linear's output as its own (Llama's MLP returns down_proj's
  output, its attention o_proj's) keeps that Linear's input from the stage that collected it and,
  next stage, answers with that one product, its other Linear modules not running again.

The plan comes from one probing forward of the first batch with the block's hooks set aside.
Blocks whose Linear modules are not each called exactly once (mixture-of-experts routing), or
where a module other than a Linear is watched, are refused (``NotSequential``) and take the
two-pass route. Memory: on top of the block's inputs, for a Llama block, the attention's output
(hidden size) and down_proj's input (intermediate size) of every calibration token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmpress.errors import UnsupportedModelError
from llmpress.memory import release_free_memory
from llmpress.pipelines.slots import BufferPool, Slots

__all__ = ["NotSequential", "calibrate_block", "hand_on", "kept_bytes", "plan_block"]

Inputs = list[tuple[tuple, dict]]


class NotSequential(Exception):
    """This block cannot be calibrated module by module (the message says why)."""


class _Stop(BaseException):
    """The stage's group has seen this batch's input (a BaseException: model code that catches
    Exception must not swallow it)."""


@dataclass
class BlockPlan:
    groups: list[list[nn.Module]]  # Linear modules in call order, grouped by shared input
    modules: list[nn.Module]  # the block's submodules called exactly once, in call order
    ancestors: dict[int, list[nn.Module]]  # id(module) -> enclosing submodules, innermost first
    linears: dict[int, set[int]] = field(default_factory=dict)  # id(module) -> ids of Linear modules in it
    answers: dict[int, tuple[nn.Module, int | None]] = field(default_factory=dict)  # id(parent) -> (its last
    # Linear, length of the tuple it returns with that Linear's output first and None after; None: the output itself)
    parked_bytes_per_token: int = 0  # the inputs parked for the Linears that answer for their parents


@contextmanager
def _hooks_set_aside(block: nn.Module) -> Iterator[None]:
    """The block's forward hooks (the modifiers' among them) do not run inside."""
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in block.modules()]
    for module, _, _ in saved:
        module._forward_pre_hooks, module._forward_hooks = type(module._forward_pre_hooks)(), type(module._forward_hooks)()
    try:
        yield
    finally:
        for module, pre, post in saved:
            module._forward_pre_hooks, module._forward_hooks = pre, post


def _answer_shape(output: Any, inner: Any) -> int | None | bool:
    """How ``output`` (a parent's) carries ``inner`` (its Linear's): None when it is ``inner``,
    the tuple's length when ``inner`` comes first and None after, False otherwise."""
    if output is inner:
        return None
    if isinstance(output, tuple) and output and output[0] is inner and all(o is None for o in output[1:]):
        return len(output)
    return False


@torch.no_grad()
def plan_block(block: nn.Module, first: tuple[tuple, dict]) -> BlockPlan:
    """Probe ``block`` on one batch (``first``: its args and kwargs) and plan the stages."""
    watched = [n for n, m in block.named_modules() if m._forward_pre_hooks and not isinstance(m, nn.Linear)]
    if watched:
        raise NotSequential(f"a module other than a Linear is watched ({watched[0]})")
    watched = [n for n, m in block.named_modules() if m._forward_hooks]
    if watched:
        raise NotSequential(f"a module's outputs are watched ({watched[0]})")
    inner = [m for m in block.modules() if m is not block]
    calls: Counter[int] = Counter()
    order: list[nn.Module] = []
    linear_inputs: list[tuple[nn.Module, Any, int | None]] = []  # (Linear, its input, the input's version)
    outputs: dict[int, Any] = {}

    def before(module: nn.Module, args: tuple) -> None:
        calls[id(module)] += 1
        order.append(module)
        if isinstance(module, nn.Linear):
            x = args[0] if args else None
            linear_inputs.append((module, x, x._version if isinstance(x, torch.Tensor) else None))

    def after(module: nn.Module, args: tuple, output: Any) -> None:
        outputs[id(module)] = output

    args, kwargs = first
    with _hooks_set_aside(block):
        for module in inner:
            module.register_forward_pre_hook(before)
            module.register_forward_hook(after)
        block(*args, **kwargs)  # the probe's hooks go with the set-aside dicts

    linears = [m for m in inner if isinstance(m, nn.Linear)]
    if not linears:
        raise NotSequential("the block has no Linear module")
    counts = sorted({calls[id(m)] for m in linears})
    if counts != [1]:
        raise NotSequential(f"its Linear modules are called {'/'.join(map(str, counts))} times in a forward, not once each")
    tokens = _rows([first])[0]
    routed = [m for m, x, _ in linear_inputs if not isinstance(x, torch.Tensor) or x.shape[:-1].numel() != tokens]
    if routed:
        raise NotSequential(f"a Linear sees a subset of the batch's tokens ({type(routed[0]).__name__}: routed experts?)")
    groups: list[list[nn.Module]] = []
    previous = None
    for module, x, version in linear_inputs:
        if groups and x is previous[0] and version == previous[1]:  # the same input, unchanged in between
            groups[-1].append(module)
        else:
            groups.append([module])
        previous = (x, version)

    parents: dict[int, nn.Module] = {}
    for parent in [block, *inner]:
        for child in parent.children():
            parents.setdefault(id(child), parent)
    ancestors: dict[int, list[nn.Module]] = {}
    for module in inner:
        chain, up = [], parents.get(id(module))
        while up is not None and up is not block:
            chain.append(up)
            up = parents.get(id(up))
        ancestors[id(module)] = chain
    once = [m for m in dict.fromkeys(order) if calls[id(m)] == 1]
    plan = BlockPlan(groups=groups, modules=once, ancestors=ancestors)
    for module in linears:
        for owner in [module, *ancestors[id(module)]]:
            plan.linears.setdefault(id(owner), set()).add(id(module))

    rank = {id(m): i for i, group in enumerate(groups) for m in group}
    for group in groups:
        if len(group) != 1:
            continue
        last = group[0]
        for parent in ancestors[id(last)]:  # innermost first: keep the outermost that qualifies
            shape = _answer_shape(outputs.get(id(parent)), outputs.get(id(last)))
            if calls[id(parent)] != 1 or shape is False:
                break
            if any(rank[i] > rank[id(last)] for i in plan.linears[id(parent)]):
                break
            plan.answers = {k: v for k, v in plan.answers.items() if v[0] is not last}
            plan.answers[id(parent)] = (last, shape)
    plan.parked_bytes_per_token = sum(last.in_features * last.weight.element_size() for last, _ in plan.answers.values())
    return plan


def kept_bytes(plan: BlockPlan, inputs: Inputs) -> int:
    """About what the stages keep besides the block's inputs: the parked inputs (and, once
    answered, the outputs) of the Linears that answer for their parents, for every batch."""
    return plan.parked_bytes_per_token * sum(r for r in _rows(inputs) if r > 0)


def hand_on(inputs: Inputs, index: int, output: Any) -> tuple | None:
    """Batch ``index``'s input becomes the block's ``output`` (its hidden states, the other
    arguments as they were), for the next block. Returns what the block returned besides the
    hidden states (None when it returned them alone), for the tail pass."""
    args, kwargs = inputs[index]
    several = isinstance(output, (tuple, list))
    inputs[index] = ((output[0] if several else output, *args[1:]), kwargs)
    return tuple(output[1:]) if several else None


def _control_flow_changed(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        what,
        got="a control flow that differs between batches",
        expected="the same submodules called once in every forward of a block",
        fix="calibrate this model with CalibrationOptions(true_sequential=False)",
    )


def _complete(plan: BlockPlan, done: set[int]) -> list[nn.Module]:
    """The outermost submodules whose Linear modules are all compressed (``done``)."""
    full = {id(m) for m in plan.modules if plan.linears.get(id(m)) and plan.linears[id(m)] <= done}
    return [m for m in plan.modules if id(m) in full and not any(id(a) in full for a in plan.ancestors[id(m)])]


@contextmanager
def _forward_replaced(replacements: dict[nn.Module, Callable[..., Any]]) -> Iterator[None]:
    saved = {m: m.__dict__.get("forward") for m in replacements}
    for module, forward in replacements.items():
        module.forward = forward
    try:
        yield
    finally:
        for module, previous in saved.items():
            if previous is None:
                del module.forward
            else:
                module.forward = previous


class _Batch:
    """The index of the batch in flight, and a check that each stand-in answers once per batch."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows
        self.index = -1
        self.answered: Counter[int] = Counter()

    def answer(self, module: nn.Module) -> int:
        self.answered[id(module)] += 1
        if self.answered[id(module)] != self.index + 1:
            raise _control_flow_changed(f"{type(module).__name__} was not called once in a forward of its block, as planned")
        return self.index


def _rows(inputs: Inputs) -> list[int]:
    """Tokens in each batch: the leading dimensions of the block's hidden states."""
    rows = []
    for args, kwargs in inputs:
        hidden = args[0] if args else kwargs.get("hidden_states")
        rows.append(hidden.shape[:-1].numel() if isinstance(hidden, torch.Tensor) and hidden.dim() > 0 else -1)
    return rows


@torch.no_grad()
def calibrate_block(block: nn.Module, inputs: Inputs, plan: BlockPlan,
                    compress: Callable[[list[nn.Module]], None], outputs_needed: bool,
                    pool: BufferPool | None = None) -> tuple | None:
    """Run the stages: for each group, collect its inputs and ``compress`` it; then (when
    ``outputs_needed``) replace each batch's input in ``inputs`` by the block's output, as the
    two-pass route does. Returns the block's extra tuple outputs, for the tail pass. The
    activations kept to the end go back to ``pool`` for the next block."""
    kept: dict[int, Slots] = {}  # id(module) -> its output for each batch
    parked: dict[int, Slots] = {}  # id(parent) -> its last Linear's input for each batch
    rows = _rows(inputs)
    done: set[int] = set()
    rest = None
    stages = len(plan.groups) + (1 if outputs_needed else 0)
    by_id = {id(m): m for m in plan.modules}
    for stage in range(stages):
        group = plan.groups[stage] if stage < len(plan.groups) else None
        has_next = stage + 1 < stages
        if pool is not None and not has_next:
            pool.clear()  # what the last block left and this one did not take, it will not
        # a parent that returns this group's (single) Linear's output answers next stage from its input
        owner = None
        if group is not None and has_next and len(group) == 1:
            owner = next((p for p, (last, _) in plan.answers.items() if last is group[0]), None)
        keep = {id(m) for m in _complete(plan, done)
                if has_next and not (owner is not None and any(id(a) == owner for a in plan.ancestors[id(m)]))}
        batch = _Batch(rows)
        replacements: dict[nn.Module, Callable[..., Any]] = {}
        for key in {*kept, *parked, *keep}:
            replacements[by_id[key]] = _stand_in(by_id[key], plan, kept, parked, batch, key in keep, pool)
        handles = []
        if group is not None:
            for module in group[:-1]:  # the group's input is what counts here, not their products
                replacements[module] = _zeros_like_output(module)
            if owner is not None:
                parked_now = Slots(rows, pool)
                handles.append(group[-1].register_forward_pre_hook(_parker(parked_now, batch), prepend=True))
            handles.append(group[-1].register_forward_pre_hook(_stop))  # after the modifiers' hooks
        try:
            with _forward_replaced(replacements):
                for index, (args, kwargs) in enumerate(inputs):
                    batch.index = index
                    try:
                        output = block(*args, **kwargs)
                    except _Stop:
                        continue
                    if group is not None:
                        raise _control_flow_changed(
                            f"{type(block).__name__}'s forward did not reach {type(group[-1]).__name__} in batch {index}")
                    rest = hand_on(inputs, index, output)
        finally:
            for handle in handles:
                handle.remove()
        skipped = [key for key in batch.answered if batch.answered[key] != len(inputs)]
        if skipped:
            raise _control_flow_changed(f"{type(by_id[skipped[0]]).__name__} was not called in every forward of its block, as planned")
        dropped = [v for k, v in kept.items() if k not in keep] + list(parked.values())
        kept = {k: v for k, v in kept.items() if k in keep}
        parked = {owner: parked_now} if owner is not None else {}
        if pool is not None and not has_next:  # what the block kept to its end serves the next one
            pool.give([b for b in (slots.release() for slots in dropped) if b is not None], survivors=(inputs, rest))
        del dropped  # the buffers not pooled go back now, before the solver's temporaries arrive
        if group is not None:
            release_free_memory()  # this stage's batch temporaries, before the solver's
            compress(group)
            done |= {id(m) for m in group}
            release_free_memory()
    return rest


def _stand_in(module: nn.Module, plan: BlockPlan, kept: dict[int, Slots], parked: dict[int, Slots],
              batch: _Batch, keep: bool, pool: BufferPool | None) -> Callable[..., Any]:
    """``module``'s forward for this stage: its kept output, its answer from the parked input of
    its last Linear, or its own forward with the output kept (``keep``) for the next stage."""
    key = id(module)
    if key in kept:
        outputs = kept[key]
        return lambda *args, **kwargs: outputs[batch.answer(module)]
    store = kept.setdefault(key, Slots(batch.rows, pool)) if keep else None
    if key in parked:
        inputs, (last, shape) = parked[key], plan.answers[key]

        def answer(*args: Any, **kwargs: Any) -> Any:
            index = batch.answer(module)
            output = last(inputs.take(index))
            output = output if shape is None else (output, *([None] * (shape - 1)))
            if store is not None:
                store.put(index, output)
                output = store[index]
            return output

        return answer
    forward = module.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        index = batch.answer(module)
        output = forward(*args, **kwargs)
        if store is not None:
            store.put(index, output)
            output = store[index]
        return output

    return run


def _zeros_like_output(module: nn.Linear) -> Callable[..., Any]:
    """A stand-in product for a group member: the stage stops at the group's last member, so
    its values are never used. One zero tensor per shape serves every batch of the stage."""
    made: dict[tuple, torch.Tensor] = {}

    def zeros(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        key = (x.shape[:-1], x.dtype, x.device)
        if key not in made:
            made[key] = x.new_zeros(*x.shape[:-1], module.out_features)
        return made[key]

    return zeros


def _parker(store: Slots, batch: _Batch) -> Callable[..., None]:
    def park(module: nn.Module, args: tuple) -> None:
        store.put(batch.index, args[0])

    return park


def _stop(module: nn.Module, args: tuple) -> None:
    raise _Stop
