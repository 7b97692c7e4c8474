"""SpinQuant's R1 / R2 folded into the weights: the Hadamard matrices, the function kept on each
family that has a rotatable residual stream, clear refusals elsewhere, and an ordinary checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import checkpoint_tensors, logits, make_tiny_llama, text_path, token_batches, trained_model_dir

import llmpress
from llmpress.errors import RecipeError, UnsupportedModelError
from llmpress.modifiers import SpinQuantModifier
from llmpress.transforms.hadamard import Rotation, hadamard_factor, hadamard_matrix

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from architectures import save_tiny  # noqa: E402


@pytest.mark.parametrize("size", [1, 2, 12, 20, 28, 36, 64, 80, 96, 576, 768, 896, 960, 1536])
def test_hadamard_matrices_of_sizes_that_are_not_powers_of_two(size):
    h = hadamard_matrix(size)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, size * torch.eye(size, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard", "random-matrix"])
def test_a_rotation_applied_to_rows_is_its_orthogonal_matrix(kind):
    rotation = Rotation(576, kind, seed=3)
    q = rotation.matrix()
    x = torch.randn(5, 576, dtype=torch.float64)
    assert torch.allclose(q @ q.T, torch.eye(576, dtype=torch.float64))
    assert torch.allclose(rotation.rows(x), x @ q) and torch.allclose(rotation.rows(x, transpose=True), x @ q.T)
    if kind != "hadamard":  # seeded: the same seed gives the same matrix, another seed another one
        assert torch.equal(Rotation(576, kind, seed=3).matrix(), q) and not torch.equal(Rotation(576, kind, seed=4).matrix(), q)


def test_a_block_diagonal_rotation_and_sizes_without_a_hadamard_matrix():
    q = Rotation(576, block=64).matrix()
    assert torch.allclose(q @ q.T, torch.eye(576, dtype=torch.float64)) and q[:64, 64:].abs().max() == 0
    assert hadamard_factor(100) is None
    with pytest.raises(RecipeError, match="transform_block_size"):
        Rotation(100)
    assert torch.allclose(Rotation(100, "random-matrix").matrix() @ Rotation(100, "random-matrix").matrix().T,
                          torch.eye(100, dtype=torch.float64))


def _with_norm_gains(model):
    """Norms with gains other than 1 (a random model's are all 1, which would hide a gain not folded)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 and "norm" in name and name.endswith("weight"):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma", "phi3", "qwen3_moe", "mixtral", "gpt_oss"])
def test_rotations_keep_the_function_of_each_family(model_type, tmp_path):
    """Grouped KV heads, Qwen3's q/k norms, Gemma's ``1 + weight`` norms, Phi-3's fused
    projections (R2 on qkv_proj's v rows), MoE routers, experts and shared experts."""
    source = save_tiny(model_type, tmp_path / "source")
    ids = torch.tensor(token_batches(2, 16, vocab=4000, seed=5))
    reference = logits(_with_norm_gains(llmpress.load(source, dtype=torch.float32)), ids)
    rotated = llmpress.oneshot(_with_norm_gains(llmpress.load(source, dtype=torch.float32)), [SpinQuantModifier()],
                               token_batches(4, 32, vocab=4000))
    assert ((logits(rotated, ids) - reference).norm() / reference.norm()) < 1e-5
    layer = rotated.model.layers[0]
    norm = layer.input_layernorm.weight
    assert torch.allclose(norm + (1 if model_type == "gemma" else 0), torch.ones_like(norm))  # folded into q/k/v


@pytest.mark.parametrize(("model_type", "why"), [("gemma2", "changes what it computes"), ("gpt2", "RMS norms")])
def test_a_residual_stream_that_cannot_be_rotated_is_refused(model_type, why, tmp_path):
    """Gemma 2 normalises o_proj's output before adding it to the stream (the check by running
    finds it); GPT-2's LayerNorm subtracts the mean. R2 alone still works on Gemma 2."""
    source = save_tiny(model_type, tmp_path / "source")
    with pytest.raises(UnsupportedModelError, match=why):
        llmpress.oneshot(_with_norm_gains(llmpress.load(source, dtype=torch.float32)), [SpinQuantModifier()],
                         token_batches(4, 32, vocab=4000))
    if model_type == "gemma2":
        ids = torch.tensor(token_batches(2, 16, vocab=4000, seed=5))
        reference = logits(_with_norm_gains(llmpress.load(source, dtype=torch.float32)), ids)
        rotated = llmpress.oneshot(_with_norm_gains(llmpress.load(source, dtype=torch.float32)), [SpinQuantModifier(rotations=["R2"])],
                                   token_batches(4, 32, vocab=4000))
        assert ((logits(rotated, ids) - reference).norm() / reference.norm()) < 1e-5


def test_r2_rotates_the_v_rows_of_a_fused_qkv_projection(tmp_path):
    source = save_tiny("phi3", tmp_path / "source")
    ids = torch.tensor(token_batches(2, 16, vocab=4000, seed=5))
    reference = logits(llmpress.load(source, dtype=torch.float32), ids)
    before = llmpress.load(source, dtype=torch.float32).model.layers[0].self_attn
    rotated = llmpress.oneshot(llmpress.load(source, dtype=torch.float32), [SpinQuantModifier(rotations=["R2"])],
                               token_batches(4, 32, vocab=4000))
    after = rotated.model.layers[0].self_attn
    kv = (after.qkv_proj.out_features - after.o_proj.in_features) // 2
    assert torch.equal(after.qkv_proj.weight[:-kv], before.qkv_proj.weight[:-kv])  # q and k rows as they were
    assert not torch.allclose(after.qkv_proj.weight[-kv:], before.qkv_proj.weight[-kv:])
    assert not torch.allclose(after.o_proj.weight, before.o_proj.weight)
    assert ((logits(rotated, ids) - reference).norm() / reference.norm()) < 1e-5


def test_online_rotations_and_learned_ones_are_refused_with_the_reason():
    with pytest.raises(RecipeError, match="online rotation"):
        SpinQuantModifier(rotations=["R1", "R2", "R3", "R4"])
    with pytest.raises(RecipeError, match="learnable"):
        SpinQuantModifier(learnable=True)


def test_a_tied_model_is_untied_and_saved_as_an_ordinary_checkpoint(tmp_path):
    """The rotated, GPTQ-quantized checkpoint of a model with tied embeddings: transformers
    loads it unchanged and computes what llmpress's reader does."""
    from transformers import AutoModelForCausalLM

    model = _with_norm_gains(make_tiny_llama(tie=True, intermediate=256))
    ids = torch.tensor(token_batches(2, 16, seed=5))
    reference = logits(model, ids)
    source = tmp_path / "source"
    model.save_pretrained(source)
    recipe = """
quant_stage:
  quant_modifiers:
    SpinQuantModifier:
      rotations: [R1, R2]
      transform_type: random-hadamard
    GPTQModifier:
      scheme: W8A16
      targets: [Linear]
      ignore: [lm_head]
"""
    out = tmp_path / "out"
    llmpress.oneshot(str(source), recipe, token_batches(8, 32), output_dir=out)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
    ours = logits(llmpress.load(out, dtype=torch.float32), ids)
    assert ((logits(loaded, ids) - ours).norm() / ours.norm()) < 1e-4
    assert ((ours - reference).norm() / reference.norm()) < 0.05  # 8-bit weights on the rotated model


def test_r1_spreads_the_outliers_of_what_the_linears_read():
    """The trained model with massive activations in a few channels of its residual stream (as
    large models have): what q_proj reads has a largest value far above its RMS per token,
    which sets a per-token quantizer's step. R1 spreads them over every channel."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(trained_model_dir()))
    ids = tokenizer(text_path("calibration.txt").read_text()[:20000], add_special_tokens=False)["input_ids"]
    batches = [ids[i * 128:(i + 1) * 128] for i in range(8)]

    def peak_over_rms(model) -> float:
        seen = []
        hooks = [layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for layer in model.model.layers]
        with torch.no_grad():
            model(input_ids=torch.tensor(batches[:4]))
        for hook in hooks:
            hook.remove()
        x = torch.cat([s.flatten(0, -2) for s in seen])
        return (x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).mean().item()

    def massive():
        model = AutoModelForCausalLM.from_pretrained(str(trained_model_dir()), dtype=torch.float32).eval()
        with torch.no_grad():
            model.model.embed_tokens.weight[:, [3, 17, 40, 77]] *= 50
        return model

    before = peak_over_rms(massive())
    after = peak_over_rms(llmpress.oneshot(massive(), [SpinQuantModifier(rotations=["R1"])], batches))
    assert before > 5 and after < 0.55 * before, (before, after)


def test_rotations_before_a_data_free_scheme_need_no_calibration_data(tmp_path, caplog):
    """SpinQuant + FP8_DYNAMIC with no dataset: the blocks' structure is read on seeded random
    tokens, the model-class path is taken (not the model-free one, which cannot rotate), and the
    rotated fp8 checkpoint computes what the dense model does, to fp8's rounding."""
    model = _with_norm_gains(make_tiny_llama(intermediate=256))
    ids = torch.tensor(token_batches(2, 16, seed=5))
    reference = logits(model, ids)
    model.save_pretrained(tmp_path / "source")
    recipe = """
quant_stage:
  quant_modifiers:
    SpinQuantModifier: {}
    QuantizationModifier: {scheme: FP8_DYNAMIC, targets: [Linear], ignore: [lm_head]}
"""
    with caplog.at_level("INFO", logger="llmpress.modifiers.rotation.spinquant"):
        llmpress.oneshot(str(tmp_path / "source"), recipe, output_dir=tmp_path / "out")
    assert "R1 and R2 on 2 blocks" in caplog.text
    ours = logits(llmpress.load(tmp_path / "out", dtype=torch.float32), ids)
    assert ((ours - reference).norm() / reference.norm()) < 0.1  # fp8 weights and inputs: 7% here, rotated or not
    norm = checkpoint_tensors(tmp_path / "out")["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))  # the gains went into q/k/v: rotated indeed
