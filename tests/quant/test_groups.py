"""Group sizes a deployed checkpoint loads with (quant/groups.py): a group that does not divide a
module's inputs becomes the largest that does (its own config group, named by its modules), or
the run is refused before any work; every preset on SmolLM2's 576-wide layers either writes
whole groups or says why first."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import llmpress
from llmpress.quant.groups import dividing_groups
from llmpress.quant.presets import PRESET_SCHEMES, preset_scheme

#: SmolLM2-135M's input widths: q/k/v/o and gate/up read 576 features, down_proj 1536
WIDTHS = {"model.layers.0.self_attn.q_proj": 576, "model.layers.0.self_attn.o_proj": 576,
          "model.layers.0.mlp.up_proj": 576, "model.layers.0.mlp.down_proj": 1536}


@pytest.mark.parametrize("preset", sorted(PRESET_SCHEMES))
def test_every_preset_writes_whole_groups_or_says_so_first(preset, caplog):
    scheme = preset_scheme(preset)
    with caplog.at_level(logging.WARNING):
        fitted = dividing_groups({name: (scheme, width) for name, width in WIDTHS.items()}, "QuantizationModifier")
    warned = "vLLM and compressed-tensors refuse" in caplog.text
    for name, width in WIDTHS.items():
        for args in (fitted[name].weights, fitted[name].input_activations):
            if args is not None and args.is_grouped and width % args.group_size:
                assert warned and "ignore" in caplog.text and name in caplog.text, (preset, name)


def test_int_groups_shrink_to_the_largest_that_divides(caplog):
    scheme = preset_scheme("W4A16")
    with caplog.at_level(logging.WARNING):
        fitted = dividing_groups({name: (scheme, width) for name, width in WIDTHS.items()}, "GPTQModifier")
    assert fitted["model.layers.0.mlp.down_proj"] is scheme  # 1536 = 12 x 128: as asked
    narrow = fitted["model.layers.0.self_attn.q_proj"]
    assert narrow.weights.group_size == 64 and narrow.weights.num_bits == 4 and scheme.weights.group_size == 128
    assert {fitted[n] is narrow for n in WIDTHS if WIDTHS[n] == 576} == {True}  # one scheme, one config group
    assert narrow.targets == [r"re:.*\.(o_proj|q_proj|up_proj)$"]
    assert "groups of 64" in caplog.text and "3 module(s)" in caplog.text
    assert dividing_groups({"a.b": (scheme, 96)}, "Q")["a.b"].weights.group_size == 32


def test_a_pattern_that_would_catch_others_becomes_names():
    """Two o_proj of different widths (a layer of another size): only the narrow one moves, named exactly."""
    scheme = preset_scheme("W4A16")
    fitted = dividing_groups({"m.layers.0.o_proj": (scheme, 576), "m.layers.1.o_proj": (scheme, 1024)}, "Q")
    assert fitted["m.layers.0.o_proj"].targets == ["m.layers.0.o_proj"]
    assert fitted["m.layers.1.o_proj"] is scheme


def test_an_experts_blocks_projections_take_one_group_named_as_experts():
    """gate/up read 64 features and down 128: all three take groups of 64 (vLLM serves a block's
    experts as one layer of one scheme), targeted as experts (transformers 5 finds the experts'
    group by an ``re:`` target naming them); the attention keeps its own pattern."""
    scheme = preset_scheme("W4A16")
    widths = {f"m.layers.{layer}.mlp.experts.{e}.{p}": 128 if p == "down_proj" else 64
              for layer in range(2) for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")}
    widths |= {"m.layers.0.self_attn.q_proj": 64, "m.layers.0.self_attn.o_proj": 256}
    fitted = dividing_groups({name: (scheme, width) for name, width in widths.items()}, "Q")
    moved = {fitted[n].weights.group_size for n in widths if ".experts." in n}
    assert moved == {64} and fitted["m.layers.0.self_attn.o_proj"] is scheme
    experts = fitted["m.layers.1.mlp.experts.2.down_proj"]
    assert experts is fitted["m.layers.0.self_attn.q_proj"]  # one scheme and group: one config group
    assert experts.targets == [r"re:.*\.(q_proj)$", r"re:.*\.experts\.\d+\.(down_proj|gate_proj|up_proj)$"]
    w8 = preset_scheme("W8A16")
    one_block = dividing_groups({n: (scheme, w) for n, w in widths.items() if "layers.0.mlp" in n or "o_proj" in n}
                                | {n: (w8, w) for n, w in widths.items() if "layers.1.mlp" in n}, "Q")
    assert one_block["m.layers.0.mlp.experts.0.up_proj"].targets == [r"re:m\.layers\.0\.mlp\.experts\.\d+\.(down_proj|gate_proj|up_proj)$"]


def test_no_fitting_group_is_said_before_any_work_with_the_fix(caplog):
    """llmpress keeps its shorter last group (it reads it back), and says what vLLM needs instead."""
    scheme = preset_scheme("W4A16")
    with caplog.at_level(logging.WARNING):
        assert dividing_groups({"m.layers.0.q_proj": (scheme, 100)}, "QuantizationModifier")["m.layers.0.q_proj"] is scheme
    assert "100 input features" in caplog.text and "strategy: channel" in caplog.text and "ignore" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        dividing_groups({"m.layers.0.q_proj": (preset_scheme("NVFP4A16"), 200)}, "QuantizationModifier")
    assert "groups of 16" in caplog.text and "strategy: channel" not in caplog.text


@pytest.mark.parametrize("model_free", [True, False])
def test_576_wide_llama_loads_in_transformers(tmp_path, model_free):
    """The W4A16 preset on 576-wide layers: both paths write the same two config groups, and
    transformers + compressed-tensors runs the file with llmpress's logits."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                                      num_key_value_heads=3, head_dim=64, vocab_size=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    recipe = "quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {targets: [Linear], ignore: [lm_head], scheme: W4A16}\n"
    llmpress.oneshot(tmp_path / "m", recipe, output_dir=tmp_path / "q", model_free=model_free)
    groups = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert sorted((g["weights"]["group_size"], tuple(g["targets"])) for g in groups.values()) == [
        (64, (r"re:.*\.(gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)$",)), (128, ("Linear",))]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "q"), dtype=torch.float32).eval()
    ours = llmpress.load(tmp_path / "q", dequantize=True)
    ids = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert float((a - b).norm() / b.norm()) < 1e-5


def test_inspect_says_per_group_whether_vllm_loads_it(tmp_path):
    """The tiny Llama's down_proj reads 200 features: no int4 group vLLM takes divides them."""
    from helpers import make_tiny_llama

    from llmpress.loading.inspect import describe_checkpoint

    llmpress.oneshot(make_tiny_llama(), "W4A16", output_dir=tmp_path / "q")
    (group,) = describe_checkpoint(tmp_path / "q")["groups"]  # hidden 128: groups of 128 fit everything else
    assert group["vllm"].startswith("refused: 2 module(s)") and "down_proj: 200" in group["vllm"] and "128" in group["vllm"]
    wide = tmp_path / "wide"
    llmpress.oneshot(make_tiny_llama(intermediate=256), "W4A16", output_dir=wide)
    assert [g["vllm"] for g in describe_checkpoint(wide)["groups"]] == ["loads (every group whole)"]
