"""AutoRound: the tuned rounding's grid, its gradients and sample order, the block loop, and
checkpoints that load and read as ordinary compressed-tensors ones."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from helpers import logits, make_tiny_llama, token_batches, trained_model_dir

import llmpress
from llmpress.errors import RecipeError, SessionError
from llmpress.modifiers import AutoRoundModifier, QuantizationModifier
from llmpress.modifiers.autoround import tuning
from llmpress.modifiers.autoround.rounding import TunedWeight
from llmpress.modifiers.autoround.tuning import sample_order
from llmpress.quant.observers import weight_global_scale
from llmpress.quant.presets import preset_scheme
from llmpress.quant.qdq import compute_qparams, fake_quantize, reduce_min_max
from llmpress.quant.scheme import QuantizationArgs
from llmpress.recipe import Recipe


def _weight(rows: int = 48, cols: int = 96, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator) * torch.linspace(0.2, 2.0, cols)


@pytest.mark.parametrize("args", [
    QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=32),
    QuantizationArgs(num_bits=8, symmetric=False, strategy="channel"),
    preset_scheme("NVFP4A16", ["Linear"]).weights,
    preset_scheme("MXFP4A16", ["Linear"]).weights,
    preset_scheme("FP8", ["Linear"]).weights,
], ids=["int4-asym-g32", "int8-asym-channel", "nvfp4", "mxfp4", "fp8-channel"])
def test_untuned_rounding_is_round_to_nearest_over_the_min_max_range(args):
    weight = _weight()
    global_scale = weight_global_scale([weight]) if args.has_global_scale else None
    tuned = TunedWeight(weight, args, global_scale)
    expected = fake_quantize(weight, *compute_qparams(*reduce_min_max(weight, args), args, global_scale), args, global_scale)
    torch.testing.assert_close(tuned.dequantized(), expected, rtol=0, atol=1e-6)
    stored, scale, _ = tuned.final()
    torch.testing.assert_close(stored, expected, rtol=0, atol=1e-6)


def test_symmetric_integers_use_the_whole_grid():
    """Each group's larger side lands on -8 (a negative scale where that side is positive): 16
    levels of absmax / 8, every weight within half a step."""
    args = preset_scheme("W4A16", ["Linear"]).weights
    weight = _weight(cols=256)
    tuned = TunedWeight(weight, args, None)
    stored, scale, zero_point = tuned.final()
    torch.testing.assert_close(tuned.dequantized(), stored, rtol=0, atol=0)
    assert zero_point is None and (scale < 0).any() and (scale > 0).any()
    steps = scale.repeat_interleave(128, dim=1)
    q = stored / steps
    torch.testing.assert_close(q, q.round(), rtol=0, atol=1e-4)
    assert q.round().min() == -8 and q.round().max() <= 7
    inside = weight.abs() <= 7 * steps.abs()  # the smaller side beyond 7 steps is clipped
    assert ((stored - weight).abs()[inside] <= steps.abs()[inside] / 2 + 1e-6).all()
    absmax = weight.reshape(48, 2, 128).abs().amax(-1)
    torch.testing.assert_close(scale.abs(), absmax / 8)


def test_gradients_reach_the_offsets_and_both_range_scales():
    args = QuantizationArgs(num_bits=3, symmetric=False, strategy="group", group_size=32)
    tuned = TunedWeight(_weight(), args, None)
    x = torch.randn(64, 96)
    (x @ tuned.dequantized().t()).square().sum().backward()
    for p in tuned.parameters:
        assert p.grad is not None and p.grad.abs().sum() > 0
    with torch.no_grad():
        tuned.offset.fill_(0.9)
        tuned.max_scale.fill_(1.5)
    tuned.clamp_()
    assert tuned.offset.max() == 0.5 and tuned.max_scale.max() == 1.0


@pytest.mark.parametrize("args", [
    QuantizationArgs(num_bits=3, symmetric=True, strategy="group", group_size=64),
    QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=32),
    QuantizationArgs(num_bits=8, symmetric=True, strategy="channel"),
    preset_scheme("NVFP4A16", ["Linear"]).weights,
    preset_scheme("MXFP4A16", ["Linear"]).weights,
], ids=["int3-sym-g64", "int4-asym-g32", "int8-sym-channel", "nvfp4", "mxfp4"])
def test_native_operators_give_pytorchs_values_and_gradients(args, monkeypatch):
    """The fused operators (native/autoround.cpp) against PyTorch's autograd on the same tuned
    values: the weight bit for bit, the offsets' gradients too, the range scales' to float32
    rounding (summed in another order), on a tail group (100 columns) and values outside range."""
    from llmpress import native
    if not native.available():
        pytest.skip("llmpress's CPU kernels are not built here")
    cols = 100 if args.is_grouped and not args.is_fp4 else 96
    weight, grad = _weight(rows=40, cols=cols), torch.randn(40, cols)
    global_scale = weight_global_scale([weight]) if args.has_global_scale else None
    results = []
    for fused in (True, False):
        monkeypatch.setattr(native, "available", (lambda: True) if fused else (lambda: False))
        tuned = TunedWeight(weight, args, global_scale)
        assert (tuned._native_group() is not None) == fused
        with torch.no_grad():
            generator = torch.Generator().manual_seed(1)
            tuned.offset.uniform_(-0.6, 0.6, generator=generator)  # some past the clamp: their gradient is zero
            tuned.min_scale.uniform_(0.6, 1.0, generator=generator)
            tuned.max_scale.uniform_(0.6, 1.0, generator=generator)
        values = tuned.dequantized()
        (values * grad).sum().backward()
        results.append((values.detach(), tuned.final()[0], [p.grad for p in tuned.parameters]))
    (fused_values, fused_final, fused_grads), (values, final, grads) = results
    assert torch.equal(fused_values, values) and torch.equal(fused_final, final)
    assert torch.equal(fused_grads[0], grads[0]) and (grads[0] == 0).any()
    for fused_grad, grad_ in zip(fused_grads[1:], grads[1:]):
        torch.testing.assert_close(fused_grad, grad_, rtol=1e-5, atol=1e-5 * grad_.abs().max().item())


@pytest.mark.parametrize("fused", [True, False], ids=["native", "pytorch"])
def test_a_weight_within_half_a_step_past_the_grid_can_still_round_inward(fused, monkeypatch):
    """The clamp is taken after the rounding (as auto-round takes it): 3.3 steps rounds to 3, on
    the 3-bit grid [-4, 3], so its offset gets a gradient (it may go to 2); 3.7 rounds to 4, past
    the end, and gets none."""
    from llmpress import native
    if fused and not native.available():
        pytest.skip("llmpress's CPU kernels are not built here")
    monkeypatch.setattr(native, "available", (lambda: True) if fused else (lambda: False))
    args = QuantizationArgs(num_bits=3, symmetric=True, strategy="channel")
    tuned = TunedWeight(torch.tensor([[-4.0, 3.3, 3.7, 1.0] * 4]), args, None)  # the scale: 4 / 4 = 1
    values = tuned.dequantized()
    assert values[0, :4].tolist() == [-4.0, 3.0, 3.0, 1.0]
    values.sum().backward()
    assert tuned.offset.grad[0, :4].tolist() == [1.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("fused", [True, False], ids=["native", "pytorch"])
def test_fp4_clamps_before_the_rounding_as_auto_rounds_fp4_quantizers_do(fused, monkeypatch):
    """On fp4's grid (its largest value 6) the clamp comes first: 6.3 steps rounds to 6 but is
    past the range, so its offset gets no gradient; 5.7 and -6 are in range and get one."""
    from llmpress import native
    if fused and not native.available():
        pytest.skip("llmpress's CPU kernels are not built here")
    monkeypatch.setattr(native, "available", (lambda: True) if fused else (lambda: False))
    args = preset_scheme("NVFP4A16", ["Linear"]).weights
    weight = torch.tensor([[-6.0, 6.3, 5.7, 1.0] * 4])
    tuned = TunedWeight(weight, args, torch.ones(1))
    with torch.no_grad():  # steps of exactly 1: the scales' range 6.3 / 6 times 6 / 6.3
        tuned.max_scale.fill_(6.0 / 6.3)
        tuned.min_scale.fill_(6.0 / 6.3)
    assert tuned._native_group() is (16 if fused else None)
    values = tuned.dequantized()
    assert values[0, :4].tolist() == [-6.0, 6.0, 6.0, 1.0]
    values.sum().backward()
    assert tuned.offset.grad[0, :4].tolist() == [1.0, 0.0, 1.0, 1.0]


def test_a_bf16_scale_is_the_one_tuned_and_stored():
    """The scale is rounded to the stored dtype while tuning too: the weight kept is on the grid
    of the bf16 scale the checkpoint holds."""
    args = preset_scheme("W4A16", ["Linear"]).weights
    tuned = TunedWeight(_weight(cols=256), args, None, scale_dtype=torch.bfloat16)
    stored, scale, _ = tuned.final()
    assert scale.dtype == torch.bfloat16
    torch.testing.assert_close(tuned.dequantized(), stored, rtol=0, atol=0)
    q = stored / scale.float().repeat_interleave(128, dim=1)
    torch.testing.assert_close(q, q.round(), rtol=0, atol=1e-4)


def test_samples_are_drawn_in_seeded_shuffled_runs():
    order = sample_order(10, 4, 6, seed=3)
    assert order == sample_order(10, 4, 6, seed=3) and order != sample_order(10, 4, 6, seed=4)
    assert all(len(step) == 4 and len(set(step)) == 4 for step in order)
    assert not set(order[0]) & set(order[1])  # one shuffle, taken in runs
    assert not set(order[2]) & set(order[3])  # two left over: a new shuffle
    assert [sorted(step) for step in sample_order(3, 8, 2, seed=0)] == [[0, 1, 2], [0, 1, 2]]


def _losses(caplog) -> dict[int, tuple[float, float]]:
    """Each tuned layer's loss, round-to-nearest's and the best, from the run's log."""
    found = {}
    for record in caplog.records:
        match = re.search(r"layer (\d+): .*loss (\S+) -> (\S+) ", record.getMessage())
        if record.name == "llmpress.modifiers.autoround.modifier" and match:
            found[int(match[1])] = (float(match[2]), float(match[3]))
    caplog.clear()
    return found


def _autoround(**fields) -> AutoRoundModifier:
    return AutoRoundModifier(**{"scheme": "W4A16", "ignore": ["lm_head"], "iters": 30, "batch_size": 4, **fields})


def test_tuning_lowers_each_blocks_loss_and_the_logits_error(caplog):
    caplog.set_level(logging.INFO, logger="llmpress.modifiers.autoround.modifier")
    ids = torch.tensor(token_batches(1, 32, seed=9))
    reference = logits(make_tiny_llama(intermediate=256), ids)
    errors = {}
    for name, modifier in [("rtn", QuantizationModifier(scheme="W4A16", ignore=["lm_head"])), ("autoround", _autoround())]:
        model = llmpress.oneshot(make_tiny_llama(intermediate=256), [modifier], token_batches(16, 32))
        errors[name] = float((logits(model, ids) - reference).square().mean())
    assert errors["autoround"] < errors["rtn"]
    losses = _losses(caplog)
    assert sorted(losses) == [0, 1] and all(best < first for first, best in losses.values())


def test_stacked_samples_and_batches_run_one_by_one_tune_alike(monkeypatch, caplog):
    """Samples stack into one forward where the batches differ only in their hidden states; a
    step over the same samples one batch at a time gives the same loss and gradients. (Compared
    at the first step: later steps follow the gradients' signs, which float rounding flips where
    a gradient is near zero, so two runs' trajectories part by the machine's kernels.)"""
    caplog.set_level(logging.INFO, logger="llmpress.modifiers.autoround.modifier")
    reduce = tuning._reduce_gradients
    runs, gradients = {}, {}

    def recorded(params):
        gradients[stack].append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
        reduce(params)

    monkeypatch.setattr(tuning, "_reduce_gradients", recorded)
    for stack in (True, False):
        gradients[stack] = []
        if not stack:
            monkeypatch.setattr(tuning, "_stackable", lambda inputs: False)
        llmpress.oneshot(make_tiny_llama(intermediate=256), [_autoround(iters=5, batch_size=16)], token_batches(16, 32))
        runs[stack] = _losses(caplog)
    assert sorted(runs[True]) == [0, 1] and len(gradients[True]) == len(gradients[False]) == 10
    for layer in runs[True]:
        assert runs[True][layer][0] == pytest.approx(runs[False][layer][0], rel=1e-4)
    first, other = gradients[True][0], gradients[False][0]  # layer 0, step 0: the same weights and inputs
    assert float((first - other).norm() / other.norm()) < 1e-2  # 1.6e-3 seen: a residual of nearly equal outputs


def test_the_checkpoint_loads_with_the_tuned_model_s_logits(tmp_path, capsys):
    """Negative scales and all: llmpress.load runs what the session left in memory."""
    ids = torch.tensor(token_batches(1, 24, seed=5))
    model = llmpress.oneshot(make_tiny_llama(intermediate=256), [_autoround(iters=10)], token_batches(8, 32),
                             output_dir=tmp_path / "out")
    expected = logits(model, ids)
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 128, True)
    loaded = llmpress.load(tmp_path / "out", dtype=torch.float32)
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=1e-3, atol=1e-3)
    from transformers import AutoModelForCausalLM  # transformers + compressed-tensors decompress them alike

    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    torch.testing.assert_close(logits(theirs, ids), expected, rtol=1e-3, atol=1e-3)
    from llmpress.cli import main

    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "out")]) == 0
    shown = capsys.readouterr().out
    assert "AutoRound: 2 layer(s), 10 steps of 4 samples each" in shown and "layer 1: " in shown


def test_the_example_recipe_reads_as_llm_compressor_writes_it():
    from helpers import REPO

    modifiers = Recipe.from_file(REPO / "examples" / "recipes" / "autoround_w4a16.yaml").modifiers
    assert [type(m).__name__ for m in modifiers] == ["AutoRoundModifier"]
    assert (modifiers[0].config.iters, modifiers[0].config.batch_size, modifiers[0].config.scheme) == (200, 8, "W4A16")


@pytest.mark.parametrize("scheme", ["W4A16_ASYM", "NVFP4", "W8A8"])
def test_other_grids_tune_and_keep_their_format(scheme, caplog):
    caplog.set_level(logging.INFO, logger="llmpress.modifiers.autoround.modifier")
    modifier = _autoround(scheme=scheme, iters=16, batch_size=8)  # every sample each step: losses compare
    model = llmpress.oneshot(make_tiny_llama(intermediate=256), [modifier], token_batches(8, 32))
    q_proj = model.model.layers[0].self_attn.q_proj
    losses = _losses(caplog)
    assert len(losses) == 2 and any(best < first for first, best in losses.values())
    weight, scale = q_proj.weight.float(), q_proj.weight_scale.float()
    if scheme == "W4A16_ASYM":
        assert q_proj.weight_zero_point.dtype == torch.int8 and (scale > 0).all()
        q = weight / scale.repeat_interleave(128, dim=1) + q_proj.weight_zero_point.float().repeat_interleave(128, dim=1)
        assert q.round().min() >= -8 and q.round().max() <= 7
    if scheme == "W8A8":  # int8 per channel, inputs per token at run time: nothing static
        q = weight / scale
        assert q.round().abs().max() <= 128 and not hasattr(q_proj, "input_scale")
    if scheme == "NVFP4":  # q/k/v share one global scale, as vLLM fuses them; values on the fp4 grid
        attention = model.model.layers[0].self_attn
        assert torch.equal(q_proj.weight_global_scale, attention.k_proj.weight_global_scale)
        assert hasattr(q_proj, "input_global_scale")
        q = weight / (scale / q_proj.weight_global_scale).repeat_interleave(16, dim=1)
        grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
        assert (q.abs().unsqueeze(-1) - grid).abs().amin(-1).max() < 1e-3


def test_no_steps_round_over_the_searched_range():
    """``iters: 0``: round to nearest over the range search, auto-round's optimized RTN;
    ``disable_opt_rtn``: over min/max, QuantizationModifier's own result."""
    batches = token_batches(4, 32)
    plain = llmpress.oneshot(make_tiny_llama(), [QuantizationModifier(scheme="W4A16", ignore=["lm_head"])], batches)
    searched = llmpress.oneshot(make_tiny_llama(), [_autoround(iters=0)], batches)
    minmax = llmpress.oneshot(make_tiny_llama(), [_autoround(iters=0, disable_opt_rtn=True)], batches)
    weight = lambda m: m.model.layers[1].mlp.down_proj.weight  # noqa: E731
    assert torch.equal(weight(minmax), weight(plain)) and not torch.equal(weight(searched), weight(plain))


def test_llm_compressor_recipe_runs_unchanged():
    recipe = Recipe.from_yaml("""
test_stage:
  quant_modifiers:
    AutoRoundModifier:
      iters: 4
      enable_torch_compile: true
      batch_size: 2
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          input_activations: null
          output_activations: null
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 64}
""")
    model = llmpress.oneshot(make_tiny_llama(), recipe, token_batches(4, 32))
    assert model.model.layers[0].mlp.up_proj.weight_scale.shape == (200, 2)


@pytest.mark.parametrize("fields, words", [({"iters": -1}, "iters"), ({"batch_size": 0}, "batch_size"),
                                           ({"lr": 0}, "lr"), ({"device_ids": "0,1"}, "one device")])
def test_fields_that_cannot_work_are_refused(fields, words):
    with pytest.raises(RecipeError, match=words):
        _autoround(**fields)


def test_autoround_is_one_shot_only():
    model = make_tiny_llama()
    session = llmpress.Session([_autoround()])
    session.update_state(model=model, calibration_data=token_batches(2, 16),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=4)
    session.initialize()
    with pytest.raises(SessionError, match="one-shot"):
        session.batch_start()


def test_the_trained_model_gains_over_round_to_nearest(trained_data):
    """On the trained test model: few steps already bring W4A16 below round-to-nearest."""
    from llmpress.evaluation import perplexity

    calibration, tokenizer, windows = trained_data
    text = open(calibration).read()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    batches = [ids[i * 256:(i + 1) * 256] for i in range(16)]
    load = lambda: llmpress.load(trained_model_dir(), dtype=torch.float32)  # noqa: E731
    rtn = llmpress.oneshot(load(), [QuantizationModifier(scheme="W4A16", ignore=["lm_head"])], batches)
    tuned = llmpress.oneshot(load(), [_autoround(iters=40)], batches)
    assert perplexity(tuned, windows, progress=False).perplexity < perplexity(rtn, windows, progress=False).perplexity


@pytest.mark.parametrize("family", ["gpt2", "qwen3_moe"])
def test_conv1d_and_experts_tune_and_reload(family, tmp_path, caplog):
    """GPT-2's Conv1D (stored [in, out], its groups along that last dimension) and a block of
    per-expert Linears, each expert seeing its routed tokens: tuned, saved and read back."""
    from architectures import save_tiny

    caplog.set_level(logging.INFO, logger="llmpress.modifiers.autoround.modifier")
    source = save_tiny(family, tmp_path / family)
    ids = torch.tensor(token_batches(1, 24, seed=3, vocab=256))
    model = llmpress.oneshot(llmpress.load(source, dtype=torch.float32), [_autoround(iters=8, batch_size=8)], token_batches(8, 32, vocab=256),
                             output_dir=tmp_path / "out")
    assert any(best < first for first, best in _losses(caplog).values())
    loaded = llmpress.load(tmp_path / "out", dtype=torch.float32)
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=1e-3, atol=1e-3)


def test_a_resumed_run_keeps_the_finished_layers_losses_and_says_what_differs(tmp_path, monkeypatch, caplog):
    from helpers import Stop, four_layers, oneshot_stopping_after

    from llmpress.data import CalibrationOptions

    caplog.set_level(logging.WARNING, logger="llmpress.modifiers.autoround.modifier")
    four_layers().save_pretrained(tmp_path / "model")
    recipe, options, out = [_autoround(iters=3)], CalibrationOptions(num_samples=None, seq_len=32, batch_size=2), tmp_path / "out"
    with pytest.raises(Stop):
        oneshot_stopping_after(tmp_path, out, recipe=recipe, options=options, stop_after=1, monkeypatch=monkeypatch)
    oneshot_stopping_after(tmp_path, out, recipe=recipe, options=options, resume=True)
    layers = json.loads((out / "config.json").read_text())["llmpress_autoround"]["layers"]
    assert [layer[0] for layer in layers] == [0, 1, 2, 3]
    assert any("resumed run" in r.getMessage() for r in caplog.records)


def test_float32_blocks_tune_under_bf16_autocast_only_where_the_device_computes_bf16(monkeypatch):
    from llmpress import native

    block = torch.nn.Linear(4, 4)
    monkeypatch.setattr(native, "bf16_native", lambda: True)
    assert isinstance(tuning._autocast(block, True), torch.autocast)
    assert not isinstance(tuning._autocast(block, False), torch.autocast)
    assert not isinstance(tuning._autocast(block.to(torch.bfloat16), True), torch.autocast)  # bf16 already
    monkeypatch.setattr(native, "bf16_native", lambda: False)
    assert not isinstance(tuning._autocast(torch.nn.Linear(4, 4), True), torch.autocast)
