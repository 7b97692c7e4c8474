"""Module-by-module ("true sequential") calibration of a block: the stages, with their kept outputs
and parked inputs, must give each group exactly the inputs, and the block exactly the outputs,
that running the whole block again for every group would give."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import make_tiny_llama, token_batches
from test_gptq import _tiny
from torch import nn

import llmpress
from llmpress.data import CalibrationOptions
from llmpress.errors import UnsupportedModelError
from llmpress.modifiers import GPTQModifier
from llmpress.pipelines import layerwise
from llmpress.pipelines.layerwise import _capture_first_layer_inputs, find_layers
from llmpress.pipelines.sequential import NotSequential, calibrate_block, plan_block
from llmpress.pipelines.slots import BufferPool


def _squash(module: nn.Linear) -> None:
    """A stand-in for compression: any change of the weight that later modules must see."""
    module.weight.data = torch.round(module.weight.data * 16) / 16


def _block_and_inputs(model: nn.Module):
    layers = find_layers(model)
    batches = [torch.tensor(token_batches(2, 16, seed=s)) for s in range(3)]
    with torch.no_grad():
        inputs = _capture_first_layer_inputs(model, layers[0], batches, torch.device("cpu"), set())
    return layers[0], inputs


def _recording(block: nn.Module, seen: dict[str, list[torch.Tensor]]) -> list:
    names = {m: n for n, m in block.named_modules()}
    return [m.register_forward_pre_hook(lambda m, a: seen.setdefault(names[m], []).append(a[0].clone()))
            for m in block.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt_neox", "phi3", "bert"])
def test_stages_give_what_rerunning_the_block_gives(arch):
    model = make_tiny_llama() if arch == "llama" else _tiny(arch)
    block, inputs = _block_and_inputs(model)
    reference_block, reference_inputs = copy.deepcopy(block), copy.deepcopy(inputs)
    plan = plan_block(block, inputs[0])
    names = {m: n for n, m in block.named_modules()}
    assert len(plan.groups) >= 3, f"{arch}: {[[names[m] for m in g] for g in plan.groups]}"

    # the stages: the hooks stand for a modifier's (they run before the stage's stop)
    seen: dict[str, list[torch.Tensor]] = {}
    handles = _recording(block, seen)
    order: list[list[str]] = []

    def compress(group):
        order.append([names[m] for m in group])
        for m in group:
            _squash(m)

    calibrate_block(block, inputs, plan, compress, outputs_needed=True)
    for handle in handles:
        handle.remove()

    # the reference: the whole block runs again for each group
    modules = dict(reference_block.named_modules())
    expected: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for group in order:
            members = {modules[n]: n for n in group}
            hooks = [m.register_forward_pre_hook(lambda m, a: expected.setdefault(members[m], []).append(a[0].clone()))
                     for m in members]
            for args, kwargs in reference_inputs:
                reference_block(*args, **kwargs)
            for hook in hooks:
                hook.remove()
            for m in members:
                _squash(m)
        outputs = [reference_block(*args, **kwargs) for args, kwargs in reference_inputs]

    assert sorted(sum(order, [])) == sorted(n for n, m in block.named_modules() if isinstance(m, nn.Linear))
    for name, tensors in expected.items():
        got = seen[name][-len(tensors):]  # a group member's first sighting is in its own stage
        for g, e in zip(got, tensors):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=f"{arch}: input of {name}")
    for (args, _), output in zip(inputs, outputs):
        expected_hidden = output[0] if isinstance(output, tuple) else output
        torch.testing.assert_close(args[0], expected_hidden, rtol=1e-5, atol=1e-6, msg=f"{arch}: block output")


def test_llama_blocks_multiply_each_linear_once():
    """Kept outputs and parked inputs spare every recomputation: q/k/v, gate and up run once
    (with compressed weights), o_proj and down_proj once more only as the parked product."""
    block, inputs = _block_and_inputs(make_tiny_llama())
    plan = plan_block(block, inputs[0])
    assert [[n.rsplit(".", 1)[-1] for n, m in block.named_modules() if m in g] for g in plan.groups] == [
        ["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
    calls: dict[str, int] = {}
    names = {m: n for n, m in block.named_modules()}
    real = {m: m.forward for m in block.modules() if isinstance(m, nn.Linear)}
    for module, forward in real.items():
        module.forward = (lambda f, n: lambda x: (calls.__setitem__(n, calls.get(n, 0) + 1), f(x))[1])(forward, names[module])
    calibrate_block(block, inputs, plan, lambda group: None, outputs_needed=True)
    assert calls == {name: len(inputs) for name in calls} and len(calls) == 7


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.proj(x))


def test_blocks_that_call_a_linear_twice_are_refused():
    with pytest.raises(NotSequential, match="called 2 times"):
        plan_block(_Twice(), ((torch.randn(2, 8),), {}))


def test_a_watched_module_other_than_a_linear_is_refused():
    block = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    block[1].register_forward_pre_hook(lambda m, a: None)
    with pytest.raises(NotSequential, match="other than a Linear"):
        plan_block(block, ((torch.randn(2, 8),), {}))


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


class _ChangesOutputsInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        y = self.inner(x)
        y += x  # in place, on a submodule's output
        return self.out(y)


def test_a_block_that_changes_a_kept_output_in_place_is_stopped():
    block = _ChangesOutputsInPlace()
    inputs = [((torch.randn(2, 8),), {}) for _ in range(2)]
    plan = plan_block(block, inputs[0])
    with pytest.raises(UnsupportedModelError, match="in place"):
        calibrate_block(block, inputs, plan, lambda group: None, outputs_needed=True)


def test_a_pooled_buffer_still_checks_for_in_place_changes():
    """A buffer from the pool has been written before (its version counter is not 0): the check
    counts from where it starts, so it neither fires for nothing nor misses a change."""
    block = _ChangesOutputsInPlace()
    inputs = [((torch.randn(2, 8),), {}) for _ in range(2)]
    plan = plan_block(block, inputs[0])
    pool = BufferPool()
    used = torch.empty(4, 8)
    used.fill_(1.0)
    pool.give([used], survivors=[])
    with pytest.raises(UnsupportedModelError, match="in place"):
        calibrate_block(block, inputs, plan, lambda group: None, outputs_needed=True, pool=pool)


def test_the_next_block_reuses_what_the_last_one_kept_with_the_same_results(monkeypatch):
    """Alike blocks keep alike activations: the second block takes the first one's buffers from
    the pool (no fresh pages) and computes exactly what it computes with buffers of its own."""
    model = make_tiny_llama()
    layers = find_layers(model)
    batches = [torch.tensor(token_batches(2, 16, seed=s)) for s in range(3)]
    with torch.no_grad():
        inputs = _capture_first_layer_inputs(model, layers[0], batches, torch.device("cpu"), set())
    takes = []
    real_take = BufferPool.take
    monkeypatch.setattr(BufferPool, "take", lambda self, shape, like: (takes.append(len(self)), real_take(self, shape, like))[1])

    def run(pool):
        blocks, state = copy.deepcopy(layers), copy.deepcopy(inputs)
        for block in blocks:
            calibrate_block(block, state, plan_block(block, state[0]), lambda g: [_squash(m) for m in g], True, pool)
        return [args[0] for args, _ in state], blocks

    plain, plain_blocks = run(None)
    assert not takes
    pooled, pooled_blocks = run(BufferPool())
    first_block_takes = len(takes) // len(layers)
    assert takes[:first_block_takes] == [0] * first_block_takes  # the first block finds the pool empty
    assert any(takes[first_block_takes:]), "the second block took nothing from the pool"
    for a, b in zip(plain, pooled):
        assert torch.equal(a, b)
    for a, b in zip(plain_blocks.parameters(), pooled_blocks.parameters()):
        assert torch.equal(a, b)


def test_the_pool_keeps_no_buffer_the_block_outputs_still_use():
    pool = BufferPool()
    in_use, free = torch.zeros(6, 4), torch.zeros(6, 4)
    outputs = [((in_use[2:4], None), {"mask": None})]  # a view of the buffer survives the block
    pool.give([in_use, free], survivors=outputs)
    assert len(pool) == 1
    assert pool.take((6, 4), torch.empty(0)) is free
    assert len(pool) == 0 and pool.take((6, 4), torch.empty(0)) is not free


def test_gptq_true_sequential_and_two_pass_share_the_first_group(caplog):
    """Both routes give q/k/v of the first block the same inputs; later groups see compressed
    modules before them only module by module, so they differ, a little."""
    weights = []
    for sequential in (True, False):
        model = make_tiny_llama()
        llmpress.oneshot(model, GPTQModifier(scheme="W4A16"), token_batches(4, 32),
                         calibration=CalibrationOptions(num_samples=4, seq_len=32, true_sequential=sequential))
        weights.append({n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("proj.weight")})
    first, second = weights
    for name in ("q_proj", "k_proj", "v_proj"):
        key = f"model.layers.0.self_attn.{name}.weight"
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=0)
    down = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(first[down], second[down])
    assert float((first[down] - second[down]).abs().mean()) < 0.2 * float(second[down].abs().mean())


def test_blocks_that_cannot_go_module_by_module_take_two_passes(monkeypatch, caplog):
    def refuse(block, first):
        raise NotSequential("a reason")

    monkeypatch.setattr(layerwise, "plan_block", refuse)
    results = []
    for sequential in (True, False):
        model = make_tiny_llama()
        with caplog.at_level(logging.INFO, logger="llmpress.pipelines.layerwise"):
            llmpress.oneshot(model, GPTQModifier(scheme="W4A16"), token_batches(4, 32),
                             calibration=CalibrationOptions(num_samples=4, seq_len=32, true_sequential=sequential))
        results.append(model.model.layers[1].mlp.down_proj.weight.detach().clone())
    assert "two passes, not module by module: a reason" in caplog.text
    assert torch.equal(*results)


class _Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 2)
        self.expert = nn.Linear(8, 8)

    def forward(self, x):
        chosen = self.router(x).argmax(-1) == 0
        out = x.clone()
        out[chosen] = self.expert(x[chosen])
        return out


def test_blocks_whose_linears_see_routed_tokens_are_refused():
    """Routed experts may get no token in a later batch: such blocks take two passes."""
    torch.manual_seed(0)
    with pytest.raises(NotSequential, match="subset of the batch's tokens"):
        plan_block(_Routed(), ((torch.randn(2, 16, 8),), {}))


def test_automatic_choice_takes_two_passes_when_the_kept_activations_dwarf_the_block(monkeypatch, caplog):
    monkeypatch.setattr(layerwise, "KEPT_PER_BLOCK_WEIGHTS", 0)
    probed = []
    monkeypatch.setattr(layerwise, "plan_block", lambda block, first: probed.append(block) or plan_block(block, first))
    model = make_tiny_llama()
    with caplog.at_level(logging.INFO, logger="llmpress.pipelines.layerwise"):
        llmpress.oneshot(model, GPTQModifier(scheme="W4A16"), token_batches(4, 32),
                         calibration=CalibrationOptions(num_samples=4, seq_len=32))
    refusals = [r.getMessage() for r in caplog.records if "two passes" in r.getMessage()]
    assert len(refusals) == len(model.model.layers) >= 2 and all("would keep" in m for m in refusals)
    assert probed == [model.model.layers[0]]  # blocks like the first are not probed again


def test_keyword_inputs_equal_across_batches_are_kept_once():
    """Rotary tables are the same for every batch of one length: after the capture every batch
    holds the first batch's tensors; the hidden states stay each batch's own."""
    model = make_tiny_llama()
    _, inputs = _block_and_inputs(model)
    before = [copy.deepcopy(kwargs["position_embeddings"]) for _, kwargs in inputs]
    layerwise._share_repeated(inputs)
    cos, sin = inputs[0][1]["position_embeddings"]
    for (args, kwargs), original in zip(inputs, before):
        assert kwargs["position_embeddings"][0] is cos and kwargs["position_embeddings"][1] is sin
        assert all(torch.equal(a, b) for a, b in zip(kwargs["position_embeddings"], original))
    assert len({id(args[0]) for args, _ in inputs}) == len(inputs)
    # a batch whose table differs (another length, say) keeps its own
    other = [(args, {**kwargs, "position_embeddings": tuple(t + 1 for t in kwargs["position_embeddings"])})
             for args, kwargs in inputs[:1]]
    mixed = inputs[:1] + other
    layerwise._share_repeated(mixed)
    assert mixed[1][1]["position_embeddings"][0] is not mixed[0][1]["position_embeddings"][0]
