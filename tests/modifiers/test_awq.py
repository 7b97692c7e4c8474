"""AWQ: scales searched against the quantizer's scheme, llm-compressor's recipes and grid, and the
perplexity it gains over round-to-nearest (the mappings it smooths: test_smoothing.py)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import logits, make_tiny_llama, text_path, token_batches, trained_model_dir
from smoothing_setup import first_block, outlier_model, rel

import llmpress
from llmpress.contract.block import CalibrationBlock
from llmpress.modifiers import AWQModifier, QuantizationModifier
from llmpress.modifiers.smoothing import find_mappings


def w3_groups():
    return {"g": {"targets": ["Linear"], "weights": {"num_bits": 3, "type": "int", "symmetric": True,
                                                     "strategy": "group", "group_size": 128}}}


@pytest.fixture(scope="module")
def trained_windows():
    from transformers import AutoTokenizer

    from llmpress.evaluation import evaluation_windows

    tokenizer = AutoTokenizer.from_pretrained(str(trained_model_dir()))
    return evaluation_windows(text_path("evaluation.txt").read_text(), tokenizer, 256, 40)


def trained():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(trained_model_dir()), dtype=torch.float32).eval()


def test_awq_lowers_the_perplexity_of_round_to_nearest(calibration_and_eval, trained_windows, caplog):
    from llmpress.evaluation import perplexity

    batches, _ = calibration_and_eval
    rtn = llmpress.oneshot(trained(), QuantizationModifier(config_groups=w3_groups(), ignore=["lm_head"]), batches)
    with caplog.at_level("INFO", logger="llmpress.modifiers.smoothing.base"):
        awq = llmpress.oneshot(trained(), [AWQModifier(), QuantizationModifier(config_groups=w3_groups(), ignore=["lm_head"])], batches)
    # the mappings it found: grouped KV heads leave v_proj -> o_proj out
    assert "input_layernorm -> q_proj, k_proj, v_proj; post_attention_layernorm -> gate_proj, up_proj; up_proj -> down_proj" in caplog.text
    assert perplexity(awq, trained_windows, progress=False).perplexity < perplexity(rtn, trained_windows, progress=False).perplexity
    # the clipping search (llmpress's addition) lowers it further before round-to-nearest
    clipped = llmpress.oneshot(trained(), [AWQModifier(apply_clip=True), QuantizationModifier(config_groups=w3_groups(), ignore=["lm_head"])],
                               batches)
    assert perplexity(clipped, trained_windows, progress=False).perplexity < perplexity(awq, trained_windows, progress=False).perplexity


def test_awq_with_gptq_and_llm_compressors_mapping_syntax(calibration_and_eval):
    batches, ids = calibration_and_eval
    recipe = """
quant_stage:
  quant_modifiers:
    AWQModifier:
      duo_scaling: both
      n_grid: 6
      mappings:
        - smooth_layer: "re:.*post_attention_layernorm$"
          balance_layers: ["re:.*gate_proj$", "re:.*up_proj$"]
    GPTQModifier:
      targets: [Linear]
      ignore: [lm_head]
      scheme: W4A16
"""
    model = llmpress.oneshot(trained(), recipe, batches[:4])
    reference = logits(trained(), ids)
    assert rel(logits(model, ids), reference) < 0.1
    awq = next(m for m in llmpress.Recipe.from_any(recipe).stages[0].modifiers if isinstance(m, AWQModifier))
    assert awq.config.mappings == [(["re:.*gate_proj$", "re:.*up_proj$"], "re:.*post_attention_layernorm$")]


def test_awq_needs_a_quantizer_after_it():
    from llmpress.errors import RecipeError

    with pytest.raises(RecipeError, match="QuantizationModifier or GPTQModifier after AWQModifier"):
        llmpress.oneshot(make_tiny_llama(), AWQModifier(), token_batches(2, 16))


def test_awq_grid_is_llm_compressors():
    from llmpress.modifiers.smoothing.awq import grid

    assert grid(20, True)[0] == (0.0, False) and len(grid(20, True)) == 20 and grid(20, True)[-1] == (1.0, True)
    assert grid(20, False) == [(i / 19, False) for i in range(20)]
    assert len(grid(20, "both")) == 20 and {duo for _, duo in grid(20, "both")} == {False, True}


def test_a_single_linear_is_scored_exactly_from_its_gram_matrix():
    from llmpress.modifiers.smoothing.awq_scores import LinearScore, RunScore

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 32)
    block = CalibrationBlock(0, torch.nn.Sequential(layer), [((torch.randn(2, 5, 16),), {}) for _ in range(3)])
    original = layer.weight.detach().clone()
    by_gram, by_run = LinearScore(block, layer, original), RunScore(block, layer)
    with torch.no_grad():
        layer.weight.add_(0.01 * torch.randn_like(layer.weight))
    assert by_gram() == pytest.approx(by_run(), rel=1e-4)


def test_channel_means_do_not_depend_on_how_the_samples_are_batched():
    """Each sequence's |x| is summed on its own, as llm-compressor sums one sample a batch: the
    mean AWQ's scales start from is the same, bit for bit, at every batch size."""
    from llmpress.modifiers.smoothing.statistics import ChannelStatistics

    x = torch.randn(6, 7, 16, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 16)
    means = []
    for size in (1, 2, 3, 6):
        stats = ChannelStatistics("norm")
        for start in range(0, 6, size):
            stats.add(x[start:start + size])
        means.append(stats.reduced()["abs_mean"])
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_run_score_joins_batches_in_runs_of_bounded_size():
    """Batches are joined into forwards of at most ``joined_tokens`` tokens (memory stays that
    of one such run, whatever the calibration set): the error is the one of a run per batch."""
    from llmpress.modifiers.smoothing.awq_scores import RunScore

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    block = CalibrationBlock(0, mlp, [((torch.randn(2, 5, 16),), {}) for _ in range(5)])
    joined, apart = RunScore(block, mlp, joined_tokens=20), RunScore(block, mlp, joined_tokens=1)
    assert [a[0].shape[0] for a, _ in joined.inputs] == [4, 4, 2] and len(apart.inputs) == 5
    with torch.no_grad():
        mlp[0].weight.add_(0.01 * torch.randn_like(mlp[0].weight))
    assert joined() == pytest.approx(apart(), rel=1e-5)


LLM_COMPRESSOR_SAVED_AWQ = """
quant_stage:
  quant_modifiers:
    AWQModifier:
      requires_calibration_data: true
      mappings:
      - smooth_layer: re:.*input_layernorm$
        balance_layers: ['re:.*q_proj$', 're:.*k_proj$', 're:.*v_proj$']
        activation_hook_target: null
      - smooth_layer: re:.*v_proj$
        balance_layers: ['re:.*o_proj$']
        activation_hook_target: null
      duo_scaling: true
      n_grid: 4
    QuantizationModifier:
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, group_size: 128, strategy: group, observer: memoryless_minmax}
      targets: [Linear]
      ignore: [lm_head]
      bypass_divisibility_checks: false
      requires_calibration_data: false
"""


def test_the_recipe_llm_compressor_saves_after_awq_runs(calibration_and_eval, caplog):
    """As llm-compressor 0.14 writes it (every field spelled out); on grouped KV heads its
    v_proj -> o_proj mapping does not fit and is skipped, with the reason."""
    batches, _ = calibration_and_eval
    with caplog.at_level("INFO", logger="llmpress.modifiers.smoothing.base"):
        llmpress.oneshot(trained(), LLM_COMPRESSOR_SAVED_AWQ, batches[:2])
    assert "v_proj -> o_proj (its output width is not the balance layers' input width)" in caplog.text


def test_the_older_single_awq_modifier_with_a_scheme_is_split_in_two(caplog):
    recipe = """
quant_stage:
  quant_modifiers:
    AWQModifier:
      scheme: W4A16_ASYM
      targets: [Linear]
      ignore: [lm_head]
      n_grid: 4
"""
    with caplog.at_level("INFO", logger="llmpress.modifiers.smoothing.awq"):
        stage = llmpress.Recipe.from_any(recipe).stages[0]
    awq, quantizer = stage.modifiers
    assert isinstance(awq, AWQModifier) and awq.config.n_grid == 4 and awq.config.ignore == ["lm_head"]
    assert isinstance(quantizer, QuantizationModifier) and quantizer.config.scheme == "W4A16_ASYM"
    assert quantizer.config.ignore == ["lm_head"] and "AWQModifier with its own scheme" in caplog.text
    llmpress.oneshot(make_tiny_llama(intermediate=256), recipe, token_batches(2, 16))


def test_mappings_are_found_in_bf16_and_a_wrong_one_still_dropped():
    model = make_tiny_llama(intermediate=256).to(torch.bfloat16)
    block = first_block(model, model.model.layers, token_batches(2, 16))
    mappings, skipped = find_mappings(block, "", [], linear_sources=True)
    assert {"input_layernorm -> q_proj, k_proj, v_proj", "post_attention_layernorm -> gate_proj, up_proj",
            "up_proj -> down_proj"} <= {m.describe() for m in mappings}
    assert any(s.startswith("gate_proj -> down_proj") for s in skipped)


def test_awq_takes_batches_of_different_lengths():
    batches = token_batches(2, 16) + token_batches(2, 24, seed=1)
    model = llmpress.oneshot(make_tiny_llama(intermediate=256), [AWQModifier(n_grid=4),
                                                                  QuantizationModifier(scheme="W4A16", ignore=["lm_head"])], batches)
    assert model.model.layers[0].self_attn.q_proj.weight_scale is not None


INT8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
INT4_G128 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
INT8_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def first_errors(weights, inputs, caplog, batches, first_layer=False, **fields):
    """AWQ's output error at ``s = 1`` on each mapping (the first layer's only: later layers'
    inputs are the earlier ones' rounded outputs), as it logs them."""
    group = {"targets": ["Linear"], "weights": weights, **({"input_activations": inputs} if inputs else {})}
    caplog.clear()
    with caplog.at_level("DEBUG", logger="llmpress.modifiers.smoothing.awq"):
        llmpress.oneshot(trained(), [AWQModifier(**fields), QuantizationModifier(config_groups={"g": group}, ignore=["lm_head"])],
                         batches[:4])
    found = re.findall(r"AWQ (\S+): output error (\S+) at s = 1", caplog.text)
    return [float(x) for name, x in found if not first_layer or name.startswith("model.layers.0.")]


def test_awq_scores_its_candidates_with_the_inputs_rounded_as_they_will_be(calibration_and_eval, caplog):
    """With int8 activations per token (W8A8), a candidate's error counts the rounding of the
    inputs ``x / s`` as well as the weights': the error at ``s = 1`` is above the weights' alone
    on every mapping (``score_rounded_inputs: false``, llm-compressor's loss, gives theirs), and on
    a model with activation outliers the scales chosen cut the output error of the quantized
    model several times, as SmoothQuant's do."""
    batches, ids = calibration_and_eval
    weights_only = first_errors(INT8_CHANNEL, None, caplog, batches, first_layer=True)
    assert first_errors(INT8_CHANNEL, INT8_TOKEN, caplog, batches, first_layer=True, score_rounded_inputs=False) == weights_only
    rounded = first_errors(INT8_CHANNEL, INT8_TOKEN, caplog, batches, first_layer=True)
    assert len(rounded) == len(weights_only) >= 3
    assert all(a8 > a16 * 1.5 for a8, a16 in zip(rounded, weights_only)), (rounded, weights_only)
    reference = logits(outlier_model(), ids)
    plain = llmpress.oneshot(outlier_model(), QuantizationModifier(scheme="W8A8", ignore=["lm_head"]), batches[:4])
    awq = llmpress.oneshot(outlier_model(), [AWQModifier(), QuantizationModifier(scheme="W8A8", ignore=["lm_head"])], batches[:4])
    assert rel(logits(awq, ids), reference) < rel(logits(plain, ids), reference) / 3


def test_awq_leaves_inputs_finer_than_the_weights_out_of_its_score_unless_asked(calibration_and_eval, caplog):
    """W4A8: int8 inputs add little to int4 weights' error, so by default the score is the
    weights' alone (each mapping's error at ``s = 1`` is W4A16's, single Linears exactly from
    their Gram matrices); ``score_rounded_inputs: true`` counts the inputs' rounding there too."""
    batches, _ = calibration_and_eval
    weights_only = first_errors(INT4_G128, None, caplog, batches, first_layer=True)
    assert first_errors(INT4_G128, INT8_TOKEN, caplog, batches, first_layer=True) == weights_only and len(weights_only) >= 3
    rounded = first_errors(INT4_G128, INT8_TOKEN, caplog, batches, first_layer=True, score_rounded_inputs=True)
    assert len(rounded) == len(weights_only) and all(r > w for r, w in zip(rounded, weights_only)), (rounded, weights_only)
