"""The fp8 KV cache (``kv_cache_scheme``): calibrated scales, saved as llm-compressor writes them,
applied by ``llmpress.load``, and kept through ``generate()``."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import logits, make_tiny_llama, token_batches

import llmpress
from llmpress.errors import LlmpressError
from llmpress.lifecycle.kv_cache import KVCacheQuantizer
from llmpress.modifiers import GPTQModifier, QuantizationModifier

KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}

RECIPE = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      kv_cache_scheme:
        num_bits: 8
        type: float
        strategy: {strategy}
        dynamic: false
        symmetric: true
"""


def rel(a, b):
    return float((a - b).norm() / b.norm())


def keys_of(model, attention, ids):
    """The keys ``attention`` caches (after rotary embedding), caught at its stand-in cache."""
    seen = []
    quantizer = KVCacheQuantizer.of(attention)
    original = quantizer.process

    def spy(module, k, v):
        seen.append(k.detach().clone())
        return original(module, k, v)

    quantizer.process = spy
    with torch.no_grad():
        model(input_ids=ids)
    quantizer.process = original
    return torch.cat(seen, dim=0)


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_kv_cache_recipe_saves_scales_and_loads(strategy, tmp_path):
    reference = make_tiny_llama(intermediate=256)
    model = make_tiny_llama(intermediate=256)
    batches = token_batches()
    llmpress.oneshot(model, RECIPE.format(strategy=strategy), batches, output_dir=tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["strategy"] == strategy and config["kv_cache_scheme"]["type"] == "float"
    assert config["config_groups"] == {}

    heads = model.config.num_key_value_heads
    attention = model.model.layers[0].self_attn
    assert tuple(attention.k_scale.shape) == ((heads, 1, 1) if strategy == "attn_head" else (1,))
    # the scale is the largest cached key over the calibration data, over fp8's largest value
    # (the first layer's keys do not depend on the quantization of any layer before it)
    keys = torch.cat([keys_of(model, attention, torch.tensor([b])) for b in batches])
    absmax = keys.abs().amax(dim=(0, 2, 3)) if strategy == "attn_head" else keys.abs().amax()
    assert torch.allclose(attention.k_scale.flatten(), (absmax / 448).flatten(), rtol=1e-5)

    ids = torch.tensor(token_batches(2, 16))
    loaded = llmpress.load(tmp_path / "c")
    assert rel(logits(loaded, ids), logits(model, ids)) < 1e-6  # the loader applies the same fp8 cache
    gap = rel(logits(loaded, ids), logits(reference, ids))
    assert 1e-6 < gap < 5e-2  # fp8 keys and values: a small, real change


def test_generate_caches_keys_on_the_fp8_grid(tmp_path):
    model = make_tiny_llama(intermediate=256)
    llmpress.oneshot(model, QuantizationModifier(scheme="W8A8", ignore=["lm_head"], kv_cache_scheme=KV),
                     token_batches(), output_dir=tmp_path / "c")
    loaded = llmpress.load(tmp_path / "c")
    from transformers import DynamicCache

    cache = DynamicCache(config=loaded.config)
    ids = torch.tensor(token_batches(2, 8))
    out = loaded.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0, cache=cache)
    assert out.shape == (2, 13)
    attention = loaded.model.layers[1].self_attn
    keys = cache.layers[1].keys.float() / attention.k_scale.float()
    assert keys.shape[-2] == 12  # prompt and new tokens went through the real cache
    assert torch.equal(keys.to(torch.float8_e4m3fn).float(), keys)


def test_gptq_with_kv_cache_scheme(tmp_path):
    model = make_tiny_llama(intermediate=256)
    llmpress.oneshot(model, GPTQModifier(scheme="W4A16", ignore=["lm_head"], kv_cache_scheme=KV),
                     token_batches(), output_dir=tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"] is not None and config["config_groups"]
    loaded = llmpress.load(tmp_path / "c")
    for ours, theirs in zip(loaded.model.layers, model.model.layers):
        assert torch.equal(ours.self_attn.v_scale, theirs.self_attn.v_scale) and ours.self_attn.v_scale.item() > 0


def test_kv_cache_scheme_of_the_scheme_modifier_reaches_gptq():
    """llm-compressor's grammar: GPTQ without a scheme takes the stage's QuantizationModifier's,
    its kv_cache_scheme included."""
    recipe = llmpress.Recipe.from_yaml(f"""
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      scheme: W8A8
      kv_cache_scheme: {json.dumps(KV)}
    GPTQModifier:
      block_size: 64
""")
    (gptq,) = recipe.modifiers
    assert isinstance(gptq, GPTQModifier) and gptq.config.kv_cache_scheme == KV


def test_checkpoint_without_its_kv_scales_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = make_tiny_llama(intermediate=256)
    llmpress.oneshot(model, QuantizationModifier(kv_cache_scheme=KV), token_batches(), output_dir=tmp_path / "c")
    state = load_file(tmp_path / "c" / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.endswith("k_scale")}, tmp_path / "c" / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(LlmpressError, match="k_scale"):
        llmpress.load(tmp_path / "c")


@pytest.mark.parametrize("bad", [{"dynamic": True}, {"num_bits": 4, "type": "int"}, {"strategy": "channel"}])
def test_unusable_kv_cache_scheme_is_refused(bad):
    with pytest.raises(LlmpressError, match="kv_cache_scheme"):
        QuantizationModifier(kv_cache_scheme={**KV, **bad})


def test_module_by_module_hands_on_what_the_fp8_cache_computes():
    """Module by module, the next block is calibrated on what the compressed block computes with
    its fp8 cache (not the attention output kept from before the cache was set): the second
    block's key scale is the largest key the finished model caches there."""
    from llmpress.data import CalibrationOptions

    model = make_tiny_llama()
    batches = token_batches(4, 32)
    llmpress.oneshot(model, GPTQModifier(scheme="W4A16", kv_cache_scheme=KV), batches,
                     calibration=CalibrationOptions(num_samples=4, seq_len=32, true_sequential=True, shuffle=False))
    attention = model.model.layers[1].self_attn
    keys = torch.cat([keys_of(model, attention, torch.tensor(batches[i : i + 2])) for i in (0, 2)])
    torch.testing.assert_close(attention.k_scale.flatten(), keys.abs().amax().reshape(1) / 448, rtol=1e-5, atol=0)


@pytest.mark.parametrize("second", ["rtn", "gptq"])
@pytest.mark.parametrize("first", ["gptq", "rtn"])
def test_a_later_stage_on_the_same_grid_leaves_the_weights_as_the_earlier_one_rounded_them(first, second):
    """GPTQ (or RTN), then a stage (RTN's or GPTQ's) that adds an fp8 KV cache with the recipe's
    scheme: the weights and scales stay the first stage's. Rounded again, a rounded weight's range
    reads 7 or 8 steps where it was 7.5, and every scale moved by 1/15."""
    import copy

    first_stage = {"GPTQModifier" if first == "gptq" else "QuantizationModifier": {"scheme": "W4A16", "ignore": ["lm_head"]}}
    one = {"quant_stage": {"quant_modifiers": first_stage}}
    later = "GPTQModifier" if second == "gptq" else "QuantizationModifier"
    two = {**one, "kv_stage": {"kv_modifiers": {later: {"scheme": "W4A16", "ignore": ["lm_head"], "kv_cache_scheme": KV}}}}
    base = make_tiny_llama(intermediate=256)
    batches = token_batches(count=4)
    once = llmpress.oneshot(copy.deepcopy(base), one, batches)
    twice = llmpress.oneshot(copy.deepcopy(base), two, batches)
    for a, b in zip(once.modules(), twice.modules(), strict=True):
        if hasattr(a, "weight_scale"):
            assert torch.equal(a.weight_scale, b.weight_scale) and torch.equal(a.weight, b.weight)
    assert getattr(twice.model.layers[0].self_attn, "k_scale", None) is not None
