"""Smoothing: mappings read from the block and checked by running, and SmoothQuant folded into the
weights (the function kept, activation outliers moved into the weights). AWQ's search: test_awq.py."""

from __future__ import annotations

import pytest
import torch
from helpers import logits, make_tiny_llama, token_batches
from smoothing_setup import add_outliers, first_block, outlier_model, rel

import llmpress
from llmpress.contract.block import CalibrationBlock
from llmpress.modifiers import AWQModifier, GPTQModifier, QuantizationModifier, SmoothQuantModifier
from llmpress.modifiers.smoothing import find_mappings, resolve_mappings


def test_mappings_follow_the_data_flow_and_are_checked_by_running():
    model = make_tiny_llama(intermediate=256)
    model.config.num_key_value_heads = 4
    model = type(model)(model.config).eval()  # no grouped KV heads: v_proj -> o_proj is a mapping too
    block = first_block(model, model.model.layers, token_batches(2, 16))
    mappings, skipped = find_mappings(block, "model.layers.0.", [], linear_sources=True)
    found = {m.describe() for m in mappings}
    assert found == {"input_layernorm -> q_proj, k_proj, v_proj", "post_attention_layernorm -> gate_proj, up_proj",
                     "v_proj -> o_proj", "up_proj -> down_proj"}
    assert any(s.startswith("gate_proj -> down_proj") for s in skipped)  # through the activation: dropped
    assert mappings[0].smooth_name.startswith("model.layers.0.")
    # a recipe's patterns, resolved in the block
    given, _ = resolve_mappings(block, "model.layers.0.", [(["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm")], [])
    assert [m.describe() for m in given] == ["post_attention_layernorm -> gate_proj, up_proj"]
    # ignored modules take their mapping out
    kept, _ = find_mappings(block, "model.layers.0.", ["re:.*input_layernorm"])
    assert {m.describe() for m in kept} == {"post_attention_layernorm -> gate_proj, up_proj"}


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_fused_linears_part_is_a_mapping(kv_heads):
    """Phi-3 fuses q/k/v and gate/up: the up half of ``gate_up_proj`` feeds ``down_proj`` (through
    the product), and without grouped KV heads the v rows of ``qkv_proj`` feed ``o_proj``. Each
    part is tried, the last first, and the one that keeps the function is the mapping; a recipe's
    ``gate_up_proj -> down_proj`` (llm-compressor's Phi-3 mapping) resolves to the same part."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from llmpress.modifiers.smoothing.fold import apply_scales

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=kv_heads, pad_token_id=0)
    model = Phi3ForCausalLM(config).eval()
    block = first_block(model, model.model.layers, token_batches(2, 16))
    mappings, skipped = find_mappings(block, "", [], linear_sources=True)
    found = {m.describe() for m in mappings}
    assert "gate_up_proj[256:512] -> down_proj" in found
    if kv_heads == 4:
        assert "qkv_proj[256:384] -> o_proj" in found
    else:  # the v rows are narrower than o_proj's input: no part of qkv_proj is a mapping
        assert "qkv_proj -> o_proj (scaling any part of its rows changes the block's output)" in skipped
    given, _ = resolve_mappings(block, "", [(["re:.*down_proj$"], "re:.*gate_up_proj$")], [])
    assert [m.describe() for m in given] == ["gate_up_proj[256:512] -> down_proj"]
    ids = torch.tensor(token_batches(2, 16, seed=3))
    before = logits(model, ids)
    for part in (m for m in mappings if m.rows):  # folded: only its rows of the fused weight change
        weight = part.smooth.weight.detach().clone()
        apply_scales(part, torch.rand(part.rows[1] - part.rows[0], generator=torch.Generator().manual_seed(1)) + 0.5)
        assert torch.equal(part.smooth.weight[:part.rows[0]], weight[:part.rows[0]])
        assert not torch.equal(part.smooth.weight[part.rows[0]:], weight[part.rows[0]:])
    assert rel(logits(model, ids), before) < 1e-5
    llmpress.oneshot(model, [AWQModifier(n_grid=4), QuantizationModifier(scheme="W4A16", ignore=["lm_head"])], token_batches(4, 32))
    assert model.model.layers[1].mlp.gate_up_proj.weight_scale is not None


def test_a_fused_linears_first_part_is_found_and_said_to_differ_from_llm_compressor(caplog):
    """An MLP whose fused ``gate_up_proj`` puts up first: the first part is the mapping, and the
    log says that a saved recipe replayed by llm-compressor (which takes the last rows) differs."""
    import logging
    import types

    from transformers import Phi3Config, Phi3ForCausalLM

    def up_first(mlp, hidden_states):
        up, gate = mlp.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return mlp.down_proj(up * mlp.activation_fn(gate))

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = Phi3ForCausalLM(config).eval()
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(up_first, layer.mlp)
    block = first_block(model, model.model.layers, token_batches(2, 16))
    mappings, _ = find_mappings(block, "", [], linear_sources=True)
    assert "gate_up_proj[0:256] -> down_proj" in {m.describe() for m in mappings}
    with caplog.at_level(logging.WARNING, logger="llmpress.modifiers.smoothing"):
        llmpress.oneshot(model, [AWQModifier(n_grid=4), QuantizationModifier(scheme="W4A16", ignore=["lm_head"])], token_batches(4, 32))
    assert sum("not its last" in r.getMessage() for r in caplog.records) == 1


def test_blocks_of_one_structure_find_and_check_their_mappings_once():
    """The second block of a structure takes the first one's candidates and checks (no run of
    its own) and gets what finding them itself gives, under its own names; ignoring is still
    decided per block."""
    from llmpress.modifiers.smoothing.mappings import MappingMemo

    model = make_tiny_llama(intermediate=256)
    layers = model.model.layers
    batches = token_batches(2, 16)
    block0 = first_block(model, layers, batches)
    block1 = CalibrationBlock(1, layers[1], block0.inputs)
    memo = MappingMemo()
    find_mappings(block0, "model.layers.0.", [], linear_sources=True, memo=memo)
    runs = []
    handle = layers[1].register_forward_pre_hook(lambda m, a: runs.append(1))
    remembered, skipped = find_mappings(block1, "model.layers.1.", [], linear_sources=True, memo=memo)
    handle.remove()
    fresh, fresh_skipped = find_mappings(block1, "model.layers.1.", [], linear_sources=True)
    assert not runs and skipped == fresh_skipped
    assert [(m.smooth_name, m.smooth, m.balance_names, m.balance) for m in remembered] == \
        [(m.smooth_name, m.smooth, m.balance_names, m.balance) for m in fresh]
    assert remembered[0].smooth_name.startswith("model.layers.1.") and remembered[0].smooth is not None
    ignored, _ = find_mappings(block1, "model.layers.1.", ["re:.*layers.1.input_layernorm"], linear_sources=True, memo=memo)
    assert not any(m.smooth_name.endswith("input_layernorm") for m in ignored) and len(ignored) == len(fresh) - 1


class _SquaredGainNorm(torch.nn.Module):
    """A norm whose gain is ``weight ** 2``: dividing its weight by ``s`` does not divide its output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight**2


def test_a_norm_that_does_not_scale_its_output_is_not_a_mapping():
    model = make_tiny_llama(intermediate=256)
    layer = model.model.layers[0]
    layer.input_layernorm = _SquaredGainNorm(128)
    block = first_block(model, model.model.layers, token_batches(1, 16))
    mappings, skipped = find_mappings(block, "", [])
    assert [m.describe() for m in mappings] == ["post_attention_layernorm -> gate_proj, up_proj"]
    assert skipped == ["input_layernorm -> q_proj, k_proj, v_proj (scaling it changes the block's output)"]


def test_a_gain_offset_is_read_by_running_the_norm():
    """``c`` of a gain ``c + weight``: 1 for Gemma's RMSNorm, 0 for Llama's and for LayerNorm
    (with its bias); the parameters are put back as they were."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from llmpress.modifiers.smoothing.fold import gain_offset

    for norm, offset in ((Gemma2RMSNorm(64), 1.0), (LlamaRMSNorm(64), 0.0), (torch.nn.LayerNorm(64), 0.0),
                         (_SquaredGainNorm(64), 0.0)):
        with torch.no_grad():
            for p in norm.parameters():
                p.normal_()
        before = {k: v.clone() for k, v in norm.state_dict().items()}
        assert gain_offset(norm) == offset, type(norm).__name__
        assert all(torch.equal(before[k], v) for k, v in norm.state_dict().items())


def test_a_bf16_one_plus_weight_norm_keeps_the_function_at_large_scales():
    """At s = 50 a Gemma norm's weight becomes ``(1 + w) / 50 - 1``, near -1, where bf16 keeps
    a few bits of the gain (5% off the function before); the balance layers take the scale the
    stored gain gives, so only bf16's own rounding is left."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from llmpress.modifiers.smoothing.fold import apply_scales
    from llmpress.modifiers.smoothing.mappings import Mapping

    torch.manual_seed(0)
    norm, linear = Gemma2RMSNorm(64).to(torch.bfloat16), torch.nn.Linear(64, 32).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        before = linear(norm(x)).float()
        apply_scales(Mapping("norm", norm, ["linear"], [linear]), torch.full((64,), 50.0))
        assert rel(linear(norm(x)).float(), before) < 1e-2
        assert ((1 + norm.weight.float()) > 0).all()  # no gain rounded to zero or past it



def family_with_outliers(family, folder):
    """The tiny random ``family`` model saved in ``folder``, with outliers in each norm that
    Linears read: Gemma's norms (gain ``1 + weight``) and GPT-2's (read by Conv1D)."""
    model = llmpress.load(folder, dtype=torch.float32)
    if family == "gpt2":
        add_outliers([pair for block in model.transformer.h
                      for pair in ((block.ln_1, [block.attn.c_attn]), (block.ln_2, [block.mlp.c_fc]))])
    else:
        add_outliers([pair for layer in model.model.layers for pair in (
            (layer.input_layernorm, [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
            (layer.pre_feedforward_layernorm, [layer.mlp.gate_proj, layer.mlp.up_proj]))], offset=1.0)
    return model


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "gpt2"])
def test_smoothquant_moves_the_outliers_of_gemma_and_gpt2(family, tmp_path):
    """Gemma's norms (gain ``1 + weight``) take ``1/s`` as ``(1 + weight) / s - 1``; GPT-2's
    c_attn / c_fc are Conv1D (``[in, out]``), whose rows take the scales. SmoothQuant alone
    keeps the function, and on activation outliers SmoothQuant + GPTQ W8A8 is far closer to the
    model than GPTQ W8A8 alone (llm-compressor 0.14 maps Gemma 2/3's post_attention_layernorm to
    gate/up_proj, which read pre_feedforward_layernorm, and finds nothing to quantize in GPT-2:
    bench/smoothing_families.py)."""
    from architectures import save_tiny

    folder = save_tiny(family, tmp_path / family)
    ids = torch.tensor(token_batches(2, 32, vocab=4000, seed=7))
    reference = logits(family_with_outliers(family, folder), ids)
    batches = token_batches(8, 64, vocab=4000)

    def run(modifiers):
        return llmpress.oneshot(family_with_outliers(family, folder), modifiers, batches)

    smoothed_alone = run([SmoothQuantModifier(smoothing_strength=0.8)])
    assert rel(logits(smoothed_alone, ids), reference) < 1e-5

    def first_norm(model):
        return model.transformer.h[0].ln_1 if family == "gpt2" else model.model.layers[0].input_layernorm

    assert not torch.equal(first_norm(smoothed_alone).weight, first_norm(family_with_outliers(family, folder)).weight)
    smoothed = rel(logits(run([SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(scheme="W8A8", ignore=["lm_head"])]), ids),
                   reference)
    plain = rel(logits(run([GPTQModifier(scheme="W8A8", ignore=["lm_head"])]), ids), reference)
    assert smoothed < plain / 4, (smoothed, plain)


def test_smoothquant_keeps_the_function_and_flattens_the_activations(calibration_and_eval):
    batches, ids = calibration_and_eval
    model = outlier_model()
    reference = logits(model, ids)
    norm = model.model.layers[0].input_layernorm.weight
    before = float(norm.abs().max() / norm.abs().median())
    llmpress.oneshot(model, SmoothQuantModifier(smoothing_strength=0.8), batches)
    after = float(norm.abs().max() / norm.abs().median())
    assert rel(logits(model, ids), reference) < 1e-4
    assert after < before / 5


def test_logarithmic_equalization_by_either_name(calibration_and_eval):
    """``algorithm: log_equalization`` divides each channel by ``range / log2(2 + range)``: the
    function kept, the outliers flattened, and llm-compressor's older name of it the same."""
    from llmpress.modifiers import LogarithmicEqualizationModifier
    from llmpress.recipe import Recipe

    batches, ids = calibration_and_eval
    reference = logits(outlier_model(), ids)
    models = {name: llmpress.oneshot(outlier_model(), modifier, batches) for name, modifier in [
        ("algorithm", SmoothQuantModifier(algorithm="log_equalization")), ("alias", LogarithmicEqualizationModifier()),
        ("smoothquant", SmoothQuantModifier())]}
    norms = {name: model.model.layers[0].input_layernorm.weight for name, model in models.items()}
    assert torch.equal(norms["algorithm"], norms["alias"]) and not torch.equal(norms["alias"], norms["smoothquant"])
    assert rel(logits(models["alias"], ids), reference) < 1e-4
    before = outlier_model().model.layers[0].input_layernorm.weight
    assert float(norms["alias"].abs().max() / norms["alias"].abs().median()) < float(before.abs().max() / before.abs().median()) / 2
    assert "LogarithmicEqualizationModifier: {}" in Recipe.from_any(LogarithmicEqualizationModifier()).to_yaml()


def test_smoothquant_makes_int8_activations_accurate_on_outliers(calibration_and_eval):
    """W8A8 (int8 weights per channel, int8 activations per token) on a model with outlier
    channels: SmoothQuant (0.8) first cuts the output error several times."""
    batches, ids = calibration_and_eval
    reference = logits(outlier_model(), ids)
    plain = llmpress.oneshot(outlier_model(), QuantizationModifier(scheme="W8A8", ignore=["lm_head"]), batches)
    smoothed = llmpress.oneshot(outlier_model(), [SmoothQuantModifier(smoothing_strength=0.8),
                                                  QuantizationModifier(scheme="W8A8", ignore=["lm_head"])], batches)
    assert rel(logits(smoothed, ids), reference) < 0.5 * rel(logits(plain, ids), reference)


def test_llm_compressor_smoothquant_gptq_recipe_runs_unchanged(calibration_and_eval, tmp_path):
    """SmoothQuant then GPTQ W8A8 in one stage: GPTQ's Hessians are of the smoothed inputs."""
    batches, ids = calibration_and_eval
    recipe = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
      mappings:
        - [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"]
        - [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"]
    GPTQModifier:
      ignore: [lm_head]
      scheme: W8A8
      targets: [Linear]
"""
    given = llmpress.oneshot(outlier_model(), recipe, batches, output_dir=tmp_path)
    found = llmpress.oneshot(outlier_model(), [SmoothQuantModifier(smoothing_strength=0.8),
                                               GPTQModifier(scheme="W8A8", ignore=["lm_head"])], batches)
    torch.testing.assert_close(logits(given, ids), logits(found, ids))  # the same mappings, found or given
    assert "SmoothQuantModifier" in (tmp_path / "recipe.yaml").read_text()


def two_pass_smoothquant_gptq(model, counted, batches):
    """SmoothQuant (0.8) + GPTQ W8A8 on ``model``, two passes a block, batches of 2: the model, and
    how many times the module ``counted(model)`` ran."""
    calls = []
    handle = counted(model).register_forward_pre_hook(lambda m, a: calls.append(1))
    llmpress.oneshot(model, [SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(scheme="W8A8", ignore=["lm_head"])],
                     batches, calibration=llmpress.CalibrationOptions(true_sequential=False, batch_size=2))
    handle.remove()
    return model, len(calls)


def test_smoothquant_reads_its_ranges_in_gptqs_observing_run(calibration_and_eval, monkeypatch):
    """Calibrated in two passes, SmoothQuant + GPTQ run each block twice, not three times:
    SmoothQuant's ranges come from GPTQ's observing run and GPTQ's Hessians are rescaled by
    ``1/s`` afterwards. The scales are those of a run of its own; the checkpoint that of the
    Hessians of the smoothed inputs, to float rounding."""
    batches, ids = calibration_and_eval
    deferred, runs = two_pass_smoothquant_gptq(outlier_model(), lambda m: m.model.layers[0].self_attn.q_proj, batches)
    monkeypatch.setattr(SmoothQuantModifier, "_watched_balance", lambda self, block, mapping: None)  # a run of its own
    own, own_runs = two_pass_smoothquant_gptq(outlier_model(), lambda m: m.model.layers[0].self_attn.q_proj, batches)
    assert own_runs - runs == len(batches) // 2  # one run of the block fewer (besides: the mapping checks)
    torch.testing.assert_close(deferred.model.layers[0].input_layernorm.weight, own.model.layers[0].input_layernorm.weight)
    reference = logits(outlier_model(), ids)
    error, own_error = rel(logits(deferred, ids), reference), rel(logits(own, ids), reference)
    assert error < 1.1 * own_error
    assert rel(logits(deferred, ids), logits(own, ids)) < 0.5 * own_error


def moe_model(family, folder):
    from architectures import save_tiny

    return save_tiny(family, folder)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_an_moe_norm_maps_to_its_router_and_every_expert(family, tmp_path, caplog):
    """The MoE block reads its norm's output through views (router, every expert while all
    calibrate) and as it is (DeepSeek's shared expert): one mapping, the router (a weight of its
    own, not a Linear) and qwen2_moe's shared-expert gate scaled too, so the function stays; AWQ
    leaves the layers the recipe ignores unquantized but scaled, and searches against the experts."""
    import logging

    model_dir = moe_model(family, tmp_path / family)
    reference = llmpress.load(model_dir, dtype=torch.float32)
    vocab = reference.config.vocab_size
    ids = torch.tensor(token_batches(2, 16, vocab=vocab))
    layer = len(reference.model.layers) - 1  # DeepSeek's first layer is dense
    before = reference.model.layers[layer]
    experts = len(before.mlp.experts)
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]
    for modifiers in ([SmoothQuantModifier(smoothing_strength=0.8)],
                      [AWQModifier(), QuantizationModifier(scheme="W4A16", ignore=ignore)]):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="llmpress.modifiers.smoothing"):
            done = llmpress.oneshot(llmpress.load(model_dir, dtype=torch.float32), modifiers, token_batches(4, 32, vocab=vocab))
        assert any("post_attention_layernorm -> " in r.getMessage() and "experts.*.gate_proj, experts.*.up_proj" in r.getMessage()
                   and f"({experts} experts)" in r.getMessage() and "gate" in r.getMessage().split("post_attention_layernorm -> ")[1]
                   for r in caplog.records), caplog.text
        after = done.model.layers[layer]
        norm, norm0 = after.post_attention_layernorm.weight, before.post_attention_layernorm.weight
        assert len(modifiers) > 1 or not torch.allclose(norm, norm0)  # AWQ may find s = 1 best on random weights
        # router columns took the scales the norm gave up: their product is unchanged
        torch.testing.assert_close(after.mlp.gate.weight * norm, before.mlp.gate.weight * norm0, rtol=1e-4, atol=1e-6)
        if len(modifiers) == 1:  # SmoothQuant alone: the same function
            assert rel(logits(done, ids), logits(reference, ids)) < 1e-5
    mlp = done.model.layers[layer].mlp
    assert mlp.experts[0].up_proj.weight_scale is not None
    if family == "qwen2_moe":  # an ignored Linear among the balance layers: scaled, not quantized
        assert getattr(mlp.shared_expert_gate, "weight_scale", None) is None


def test_an_moe_mapping_reads_its_ranges_at_an_expert_in_gptqs_observing_run(tmp_path, monkeypatch):
    """Qwen3-MoE's post-attention norm feeds its router, which GPTQ does not observe (not a
    Linear), and its experts. While every expert calibrates on every token an expert's input is
    the norm's output, so SmoothQuant reads that mapping's ranges at an expert in GPTQ's observing
    run too: one run of the block fewer, the scales of a run of its own."""
    model_dir = moe_model("qwen3_moe", tmp_path / "moe")
    vocab = llmpress.load(model_dir, dtype=torch.float32).config.vocab_size
    batches = token_batches(4, 32, vocab=vocab)

    def norm(model):
        return model.model.layers[-1].post_attention_layernorm

    deferred, runs = two_pass_smoothquant_gptq(llmpress.load(model_dir, dtype=torch.float32), norm, batches)
    monkeypatch.setattr(SmoothQuantModifier, "_watched_balance", lambda self, block, mapping: None)  # a run of its own
    own, own_runs = two_pass_smoothquant_gptq(llmpress.load(model_dir, dtype=torch.float32), norm, batches)
    assert own_runs - runs == len(batches) // 2
    # the first block: later ones calibrate on what GPTQ made of the earlier ones, and GPTQ's
    # Hessians, rescaled or of the smoothed inputs, round differently enough to flip some int8 weights
    first = deferred.model.layers[0]
    assert hasattr(first.mlp, "experts")
    for name in ("input_layernorm", "post_attention_layernorm"):
        torch.testing.assert_close(getattr(first, name).weight, getattr(own.model.layers[0], name).weight)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_the_saved_recipe_names_the_mappings_found_and_runs_again_to_the_same_checkpoint(family, tmp_path):
    """Mappings found from the blocks go into the checkpoint's recipe.yaml as llm-compressor's
    patterns (what ``llmpress inspect`` shows); the recipe object given is left as it was, and
    running the saved recipe writes the same checkpoint: each expert's up_proj -> down_proj is
    one pattern pair, resolved expert by expert."""
    from helpers import checkpoint_tensors

    from llmpress.lifecycle.records import applied_recipe
    from llmpress.recipe import Recipe

    if family == "llama":
        model_dir = tmp_path / "llama"
        make_tiny_llama().save_pretrained(model_dir)
    else:
        model_dir = moe_model(family, tmp_path / family)
    vocab = llmpress.load(model_dir, dtype=torch.float32).config.vocab_size
    batches = token_batches(4, 32, vocab=vocab)
    options = llmpress.CalibrationOptions(num_samples=None, seq_len=32)
    given = Recipe.from_any([AWQModifier(), QuantizationModifier(scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"])])
    model = llmpress.oneshot(str(model_dir), given, batches, output_dir=tmp_path / "found", calibration=options)
    assert "mappings" not in given.to_yaml()
    recorded = applied_recipe(model).modifiers  # what the model keeps: no running state
    assert recorded[0].found and not any(hasattr(m, "memo") or hasattr(m, "prefix_of") for m in recorded)
    saved = Recipe.from_file(tmp_path / "found" / "recipe.yaml")
    mappings = saved.modifiers[0].config.mappings
    assert (["re:.*\\.self_attn\\.q_proj$", "re:.*\\.self_attn\\.k_proj$", "re:.*\\.self_attn\\.v_proj$"],
            "re:.*\\.input_layernorm$") in mappings
    if family == "qwen3_moe":
        assert (["re:.*\\.mlp\\.experts\\.\\d+\\.down_proj$"], "re:.*\\.mlp\\.experts\\.\\d+\\.up_proj$") in mappings
    llmpress.oneshot(str(model_dir), tmp_path / "found" / "recipe.yaml", batches, output_dir=tmp_path / "again", calibration=options)
    one, two = checkpoint_tensors(tmp_path / "found"), checkpoint_tensors(tmp_path / "again")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_experts_without_tokens_cannot_pass_for_a_mapping(tmp_path):
    """On a one-token batch most experts get no token: a check that looked only at the routed
    output would accept anything for them (gate_proj -> down_proj through the activation). The
    check mixes every expert in, so only each expert's up_proj -> down_proj is kept; without
    all experts calibrating, the norm's mapping misses the idle experts and is skipped."""
    from llmpress.models import calibrating_all_experts

    model = llmpress.load(moe_model("qwen3_moe", tmp_path / "moe"), dtype=torch.float32)
    layers = model.model.layers
    short = [[5]]  # one token: top-2 of 4 experts, two get nothing
    with calibrating_all_experts(model):
        block = first_block(model, layers, short)
        mappings, skipped = find_mappings(block, "", [], linear_sources=True)
    found = [m.describe() for m in mappings]
    assert not any("gate_proj -> down_proj" in d for d in found)
    assert sum(d.startswith("up_proj -> down_proj") for d in found) == len(layers[0].mlp.experts)
    block = first_block(model, layers, short)  # routed tokens only
    mappings, skipped = find_mappings(block, "", [])
    assert not any(m.smooth_name.endswith("post_attention_layernorm") for m in mappings)
    assert any("did not run on the first batch" in s for s in skipped)
