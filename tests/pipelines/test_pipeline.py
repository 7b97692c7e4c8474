"""The calibration pipeline: module-by-module stages against the reference strategy, the first
block's inputs, what a block offers a modifier, and the automatic choice of route."""

from __future__ import annotations

import copy
import logging
from collections import Counter

import pytest
import torch
from helpers import make_tiny_llama, tiny_of_family, token_batches
from torch import nn

import llmpress
from llmpress.contract.block import CalibrationBlock, find_blocks
from llmpress.contract.observation import Observation
from llmpress.data import CalibrationOptions
from llmpress.errors import UnsupportedModelError
from llmpress.models import calibrating_all_experts, linearize_experts
from llmpress.modifiers import GPTQModifier, Modifier
from llmpress.pipelines import layerwise
from llmpress.pipelines.blocks import capture_block_inputs, share_repeated
from llmpress.pipelines.by_module import planner
from llmpress.pipelines.by_module.plan import BlockPlan, plan_block
from llmpress.pipelines.by_module.sequential import calibrate_block_by_module
from llmpress.pipelines.reference import calibrate_block_reference, observe_block


class _Squash(Modifier):
    """A modifier that records every input it observes and, as its "compression", rounds a
    group's weights onto a coarse grid that later modules must see."""

    def on_initialize(self, state):
        self.model, self.seen, self.order = state.model, {}, []
        self.names = {m: n for n, m in state.model.named_modules()}

    def calibration_targets(self):
        return {n: m for n, m in self.model.named_modules() if isinstance(m, nn.Linear)}

    def observe(self, name, x):
        self.seen.setdefault(name, []).append(x.clone())

    def on_modules_calibrated(self, state, block, modules):
        self.order.append([self.names[m] for m in modules])
        for module in modules:
            module.weight.data = torch.round(module.weight.data * 16) / 16


def _inputs(model: nn.Module, batches: int = 3) -> list:
    blocks = find_blocks(model)
    ids = [torch.tensor(token_batches(2, 16, seed=s)) for s in range(batches)]
    inputs, _, _ = capture_block_inputs(model, blocks, ids, torch.device("cpu"), Observation([]))
    return inputs


def _calibrate(block: nn.Module, inputs: list, by_module: bool):
    """One block through one strategy, with the same plan's groups; what the modifier saw, the
    order of compression and the block's outputs."""
    holder = nn.Module()
    holder.block = block
    session = llmpress.Session(_Squash()).initialize(model=holder)
    session.calibration_start()
    squash = session.modifiers[0]
    targets = [m for m in block.modules() if isinstance(m, nn.Linear)]
    plan = plan_block(block, inputs[0], targets, session.observation)
    assert isinstance(plan, BlockPlan), plan
    calibration = CalibrationBlock(0, block, inputs, session.observation)
    if by_module:
        calibrate_block_by_module(calibration, plan, session, outputs_needed=True)
    else:
        calibrate_block_reference(calibration, session, plan.groups, outputs_needed=True)
    session.calibration_end()
    return squash.seen, squash.order, [args[0] if args else kwargs["hidden_states"] for args, kwargs in inputs]


#: the groups each block goes in: by depth in its data flow (GPT-NeoX's attention and MLP are
#: parallel; an MoE layer's experts go together, not one group per expert)
DEPTHS = {"llama": 4, "opt": 4, "gpt_neox": 2, "phi3": 4, "bert": 4, "qwen3_moe": 4}


@pytest.mark.parametrize("arch", list(DEPTHS))
def test_module_by_module_gives_exactly_what_the_reference_gives(arch):
    model = make_tiny_llama() if arch == "llama" else tiny_of_family(arch)
    linearize_experts(model)
    block, inputs = find_blocks(model)[0], _inputs(model)
    reference_block, reference_inputs = copy.deepcopy(block), copy.deepcopy(inputs)
    with calibrating_all_experts(block), calibrating_all_experts(reference_block):
        seen, order, outputs = _calibrate(block, inputs, by_module=True)
        expected_seen, expected_order, expected_outputs = _calibrate(reference_block, reference_inputs, by_module=False)
    assert len(order) == DEPTHS[arch] and order == expected_order, order
    assert seen.keys() == expected_seen.keys()
    for name in seen:
        assert len(seen[name]) == len(expected_seen[name]) == len(inputs)
        for got, want in zip(seen[name], expected_seen[name]):
            assert torch.equal(got, want), f"{arch}: input of {name}"
    for got, want in zip(outputs, expected_outputs):
        assert torch.equal(got, want), f"{arch}: block output"
    for (name, got), want in zip(block.named_parameters(), reference_block.parameters()):
        assert torch.equal(got, want), f"{arch}: {name}"


def _by_module_and_reference(monkeypatch, modifier) -> list[dict[str, torch.Tensor]]:
    """The tiny Llama's state after oneshot module by module, then with the reference strategy
    run on the same plans instead."""
    def reference(block, plan, session, outputs_needed):
        return calibrate_block_reference(block, session, plan.groups, outputs_needed)

    states = []
    for patched in (False, True):
        if patched:
            monkeypatch.setattr(layerwise, "calibrate_block_by_module", reference)
        model = llmpress.oneshot(make_tiny_llama(), modifier.clone(), token_batches(4, 32),
                                 calibration=CalibrationOptions(num_samples=4, seq_len=32, true_sequential=True))
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def test_gptq_module_by_module_gives_the_reference_weights(monkeypatch):
    """The whole pipeline with GPTQ: the optimised stages and the reference strategy, run on the
    same plans, give the same weights bit for bit."""
    ours, reference = _by_module_and_reference(monkeypatch, GPTQModifier(scheme="W4A16"))
    for name, value in ours.items():
        assert torch.equal(value, reference[name]), name


def test_llama_blocks_multiply_each_linear_once():
    """Kept outputs and parked inputs spare every recomputation: q/k/v, gate and up run once
    (compressed), o_proj and down_proj once as the parked product."""
    model = make_tiny_llama()
    block, inputs = find_blocks(model)[0], _inputs(model)
    names = {m: n.rsplit(".", 1)[-1] for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    calls: dict[str, int] = {}
    handles = [m.register_forward_hook(lambda m, a, o: calls.__setitem__(names[m], calls.get(names[m], 0) + 1))
               for m in names]
    _calibrate(block, inputs, by_module=True)
    for handle in handles:
        handle.remove()
    assert calls == dict.fromkeys(names.values(), 1 + len(inputs))  # the plan's probe, then once a batch


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.proj(x))


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


def test_blocks_that_cannot_go_module_by_module_say_why():
    twice = _Twice()
    assert "called 2 times" in plan_block(twice, ((torch.randn(2, 8),), {}), [twice.proj])
    torch.manual_seed(0)
    routed = _Routed()
    reason = plan_block(routed, ((torch.randn(2, 16, 8),), {}), [routed.router, routed.expert])
    assert "subset of the batch's tokens" in reason


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
        y += x  # in place, on a submodule's output that a later stage answers from what it kept
        return self.out(y)


def test_a_block_that_changes_a_kept_output_in_place_still_gets_the_reference_result():
    block = _ChangesOutputsInPlace()
    inputs = [((torch.randn(2, 8, generator=torch.Generator().manual_seed(s)),), {}) for s in range(2)]
    # autograd refuses the in-place change of a traced output: the plan falls back to call order
    plan = plan_block(block, inputs[0], [block.inner.proj, block.out])
    assert plan.sources is None and plan.groups == [[block.inner.proj], [block.out]]
    reference_block, reference_inputs = copy.deepcopy(block), copy.deepcopy(inputs)
    seen, _, outputs = _calibrate(block, inputs, by_module=True)
    expected_seen, _, expected_outputs = _calibrate(reference_block, reference_inputs, by_module=False)
    for name in expected_seen:
        assert all(torch.equal(a, b) for a, b in zip(seen[name], expected_seen[name])), name
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected_outputs))


class _SkipsOnce(nn.Module):
    """A block whose second batch takes another path."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.first(x)
        return y if float(x.sum()) > 1e6 else self.second(torch.relu(y))


def test_control_flow_that_changes_between_batches_is_an_error():
    block = _SkipsOnce()
    inputs = [((torch.ones(2, 8),), {}), ((torch.full((2, 8), 1e7),), {})]
    with pytest.raises(UnsupportedModelError, match="true_sequential=False"):
        _calibrate(block, inputs, by_module=True)


def _observing_run(block: nn.Module, inputs: list) -> tuple[dict[str, int], Counter]:
    """``observe_block`` with every Linear of ``block`` watched, in one group: how many inputs
    each one handed over, and how many times each one computed its output."""
    holder = nn.Module()
    holder.block = block
    session = llmpress.Session(_Squash()).initialize(model=holder)
    session.calibration_start()
    names = {m: n for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    computed = Counter()
    handles = [m.register_forward_hook(lambda m, a, o: computed.update([names[m]])) for m in names]
    try:
        observe_block(CalibrationBlock(0, block, inputs, session.observation), session.observation, list(names))
    finally:
        for handle in handles:
            handle.remove()
        session.abandon_calibration()
    return {n.removeprefix("block."): len(x) for n, x in session.modifiers[0].seen.items()}, computed


def test_the_observing_run_stops_each_batch_after_the_last_input_it_waits_for():
    """A Llama block's observing run computes down_proj's product for the first batch only (the
    batch that shows where the last input is); every module still sees every batch's input."""
    model = make_tiny_llama()
    block, inputs = find_blocks(model)[0], _inputs(model, batches=4)
    seen, computed = _observing_run(block, inputs)
    names = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    assert seen == dict.fromkeys(names, 4)
    assert computed == {**dict.fromkeys(names, 4), "mlp.down_proj": 1}


def test_the_observing_run_stops_early_only_where_every_batch_feeds_every_module_once():
    """A module called twice per batch, or a batch that skips one, runs whole: stopping at a
    count another batch showed could drop an input that comes after it."""
    twice = _Twice()
    seen, computed = _observing_run(twice, [((torch.randn(2, 8),), {}) for _ in range(3)])
    assert seen == {"proj": 6} and computed == {"proj": 6}
    block = _SkipsOnce()  # the second module runs only on small inputs
    small, large = ((torch.ones(2, 8),), {}), ((torch.full((2, 8), 1e7),), {})
    seen, computed = _observing_run(block, [large, small, large, small, small])
    assert seen == {"first": 5, "second": 3}
    # the first small batch shows where the last input is; the later ones stop there, the large
    # ones never reach that count and run whole
    assert computed == {"first": 5, "second": 1}


def test_a_block_offers_its_submodules_inputs_and_reruns_them_unobserved():
    model = make_tiny_llama()
    block, inputs = find_blocks(model)[0], _inputs(model)
    observation = Observation([])
    calibration = CalibrationBlock(0, block, inputs, observation)
    seen = []
    handle = block.mlp.register_forward_hook(lambda m, a, o: seen.append((a[0].clone(), o.clone())))
    with torch.no_grad():
        for args, kwargs in inputs:
            block(*args, **kwargs)
    handle.remove()
    given = calibration.inputs_to(block.mlp)
    outputs = calibration.run(block.mlp, given)
    assert len(given) == len(outputs) == len(inputs)
    for (args, _), output, (x, y) in zip(given, outputs, seen):
        assert torch.equal(args[0], x) and torch.equal(output, y)
    with pytest.raises(UnsupportedModelError, match="not called once"):
        calibration.inputs_to(nn.Linear(2, 2))


def test_gptq_true_sequential_and_two_pass_share_the_first_group():
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
    monkeypatch.setattr(planner, "plan_block", lambda *args: "a reason")
    results = []
    for sequential in (True, False):
        model = make_tiny_llama()
        with caplog.at_level(logging.INFO, logger="llmpress.pipelines.by_module.planner"):
            llmpress.oneshot(model, GPTQModifier(scheme="W4A16"), token_batches(4, 32),
                             calibration=CalibrationOptions(num_samples=4, seq_len=32, true_sequential=sequential))
        results.append(model.model.layers[1].mlp.down_proj.weight.detach().clone())
    assert "two passes, not module by module: a reason" in caplog.text
    assert torch.equal(*results)


def test_automatic_choice_takes_two_passes_when_the_kept_activations_dwarf_the_block(monkeypatch, caplog):
    """The first block is probed and refused (said at INFO); the blocks like it are refused
    without a probe of their own."""
    monkeypatch.setattr(planner, "KEPT_PER_BLOCK_WEIGHTS", 0)
    probes = []
    probe = planner.plan_block
    monkeypatch.setattr(planner, "plan_block", lambda *a, **k: probes.append(1) or probe(*a, **k))
    model = make_tiny_llama()
    with caplog.at_level(logging.DEBUG, logger="llmpress.pipelines.by_module.planner"):
        llmpress.oneshot(model, GPTQModifier(scheme="W4A16"), token_batches(4, 32),
                         calibration=CalibrationOptions(num_samples=4, seq_len=32))
    refusals = [r for r in caplog.records if "two passes" in r.getMessage()]
    assert len(refusals) == len(model.model.layers) >= 2 and len(probes) == 1
    assert refusals[0].levelno == logging.INFO and "block 0" in refusals[0].getMessage() and "would keep" in refusals[0].getMessage()
    assert all(r.levelno == logging.DEBUG and "as the blocks like it: it would keep" in r.getMessage() for r in refusals[1:])


def _named(plan: BlockPlan, block: nn.Module) -> tuple:
    """A plan by its modules' names in ``block``."""
    n = {m: name for name, m in block.named_modules()}

    def names(modules) -> list[str]:
        return [n[m] for m in modules]

    return ([names(g) for g in plan.groups], names(plan.order), {n[k]: names(v) for k, v in plan.ancestors.items()},
            {n[k]: sorted(names(v)) for k, v in plan.targets_in.items()},
            {n[k]: (n[a.last], a.length) for k, a in plan.answers.items()}, {n[k]: v for k, v in plan.zeros.items()},
            plan.parked_bytes_per_token,
            *(None if found is None else {n[k]: sorted(names(v)) for k, v in found.items()} for found in (plan.sources, plan.input_sources)),
            None if plan.output_sources is None else sorted(names(plan.output_sources)))


@pytest.mark.parametrize("arch", list(DEPTHS))
def test_a_plan_moved_to_a_block_alike_is_that_blocks_own(arch):
    """What the planner gives the blocks like the first instead of probing them: the first
    block's plan, moved to their modules, is the plan their own probe finds."""
    model = make_tiny_llama() if arch == "llama" else tiny_of_family(arch)
    linearize_experts(model)
    blocks, inputs = find_blocks(model), _inputs(model)
    plans = []
    for block in blocks[:2]:
        with calibrating_all_experts(block):
            plans.append(plan_block(block, inputs[0], [m for m in block.modules() if isinstance(m, nn.Linear)]))
    assert all(isinstance(p, BlockPlan) for p in plans)
    moved = plans[0].moved_to(blocks[1], {m: name for name, m in blocks[0].named_modules()})
    assert _named(moved, blocks[1]) == _named(plans[1], blocks[1])
    assert set(moved.order) <= set(blocks[1].modules()) and not set(moved.order) & set(blocks[0].modules())


def test_the_blocks_alike_take_the_first_blocks_plan_and_the_same_weights(monkeypatch):
    """One probe for the repeated layers, and the weights of probing every one."""
    probes = []
    probe = planner.plan_block
    monkeypatch.setattr(planner, "plan_block", lambda *a, **k: probes.append(1) or probe(*a, **k))

    def oneshot() -> dict[str, torch.Tensor]:
        model = llmpress.oneshot(make_tiny_llama(), GPTQModifier(scheme="W4A16"), token_batches(4, 32),
                                 calibration=CalibrationOptions(num_samples=4, seq_len=32))
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    reused = oneshot()
    assert len(probes) == 1

    class Forgetful(dict):
        def __setitem__(self, key, value) -> None:
            pass

    start = planner.Planner.__init__
    monkeypatch.setattr(planner.Planner, "__init__", lambda self, *a, **k: start(self, *a, **k) or setattr(self, "planned", Forgetful()))
    probed = oneshot()
    assert len(probes) == 1 + len(make_tiny_llama().model.layers) > 2
    assert reused.keys() == probed.keys() and all(torch.equal(reused[k], probed[k]) for k in reused)


def test_keyword_inputs_equal_across_batches_are_kept_once():
    """Rotary tables are the same for every batch of one length: after the capture every batch
    holds the first batch's tensors; the hidden states stay each batch's own."""
    inputs = _inputs(make_tiny_llama())
    before = [copy.deepcopy(kwargs["position_embeddings"]) for _, kwargs in inputs]
    share_repeated(inputs)
    cos, sin = inputs[0][1]["position_embeddings"]
    for (args, kwargs), original in zip(inputs, before):
        assert kwargs["position_embeddings"][0] is cos and kwargs["position_embeddings"][1] is sin
        assert all(torch.equal(a, b) for a, b in zip(kwargs["position_embeddings"], original))
    assert len({id(args[0]) for args, _ in inputs}) == len(inputs)
    # a batch whose table differs (another length, say) keeps its own
    other = [(args, {**kwargs, "position_embeddings": tuple(t + 1 for t in kwargs["position_embeddings"])})
             for args, kwargs in inputs[:1]]
    mixed = inputs[:1] + other
    share_repeated(mixed)
    assert mixed[1][1]["position_embeddings"][0] is not mixed[0][1]["position_embeddings"][0]


def test_the_pipeline_folder_uses_no_private_torch_state():
    """The folder a newcomer reads: hook handles and module swaps only, files it can read whole."""
    from pathlib import Path

    folder = Path(layerwise.__file__).parent
    for path in folder.glob("*.py"):
        text = path.read_text()
        for private in ("_forward_pre_hooks", "_forward_hooks", "._version", "data_ptr", "._parameters", "._buffers", ".forward ="):
            assert private not in text, f"{path.name} uses {private}"
        assert len(text.splitlines()) <= 250, f"{path.name} has {len(text.splitlines())} lines"


def test_a_calibration_that_fails_part_way_takes_its_hooks_off_the_model(monkeypatch):
    def boom(block, plan, session, outputs_needed):
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(layerwise, "calibrate_block_by_module", boom)
    observed = []
    monkeypatch.setattr(GPTQModifier, "observe", lambda self, name, x: observed.append(name))
    model = make_tiny_llama()
    session = llmpress.Session(GPTQModifier(scheme="W4A16")).initialize(model=model, calibration_data=[])
    batches = [torch.tensor(token_batches(2, 16))]
    with pytest.raises(RuntimeError, match="out of memory"):
        layerwise.run_layerwise_calibration(model, session, batches, true_sequential=True)
    observed.clear()
    with torch.no_grad():
        model(batches[0])
    assert observed == [] and session.observation is None
    with pytest.raises(llmpress.errors.SessionError, match="failed part way"):
        session.finalize()


def test_modules_nobody_watches_are_compressed_in_their_place(monkeypatch):
    """Weight-only RTN on the attention needs no data, static fp8 inputs on the MLP do: module by
    module, the attention is handed over (and rounded) before the MLP's stages run, exactly as the
    reference strategy does it, so the next block sees a compressed attention in both."""
    from llmpress.modifiers import QuantizationModifier

    groups = {"attention": {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 4, "group_size": 32}},
              "mlp": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}

    ours, reference = _by_module_and_reference(monkeypatch, QuantizationModifier(config_groups=groups))
    assert any(k.endswith("mlp.down_proj.input_scale") for k in ours)
    for name, value in ours.items():
        assert torch.equal(value, reference[name]), name


def test_a_stage_skips_what_feeds_only_the_outputs_kept_from_before_and_what_follows_its_group():
    """Llama's norms run only in the stages that read them: the input norm for q/k/v and for
    o_proj (q/k/v run again on it), the post-attention norm for gate/up and down_proj; once the
    attention's output is kept (and the MLP answers from down_proj's parked input) they answer
    zeros. Before, the input norm ran in all five stages and the other in three."""
    model = make_tiny_llama()
    block, inputs = find_blocks(model)[0], _inputs(model)
    calls: Counter[str] = Counter()
    modules = {"input_layernorm": block.input_layernorm, "post_attention_layernorm": block.post_attention_layernorm,
               "act_fn": block.mlp.act_fn}
    handles = [m.register_forward_hook(lambda m, a, o, name=name: calls.update([name])) for name, m in modules.items()]
    _calibrate(block, inputs, by_module=True)
    for handle in handles:
        handle.remove()
    # the probe's, then twice a batch; the activation once (for down_proj's input): a stage stops
    # each batch at its group's last member (the q/k/v stage's attention and the gate/up stage's
    # product are not computed on zeros)
    assert calls == {"input_layernorm": 1 + 2 * len(inputs), "post_attention_layernorm": 1 + 2 * len(inputs),
                     "act_fn": 1 + len(inputs)}


class _DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj, self.side = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        normed = self.norm(x)
        return {"hidden_states": x + self.proj(normed), "side": self.side(normed)}


def test_the_outputs_stage_zeroes_only_what_it_saw_the_output_made_from():
    """A block whose output the probe cannot walk (a dict, a cache object) has no output
    sources: its outputs stage runs whole. A plain tensor's are the modules it came from."""
    x = ((torch.randn(2, 3, 8),), {})
    block = _DictOutput()
    plan = plan_block(block, x, [block.proj, block.side])
    assert isinstance(plan, BlockPlan) and plan.output_sources is None
    assert plan.zeroed_for(None, set()) == {}
    llama = find_blocks(make_tiny_llama())[0]
    inputs = _inputs(make_tiny_llama())
    plan = plan_block(llama, inputs[0], [m for m in llama.modules() if isinstance(m, nn.Linear)])
    assert plan.output_sources == {llama.self_attn, llama.mlp}  # the residual sums of the attention's and the MLP's
