"""Reading architectures as transformers does: the class from ``architectures``, renamed and
prefixed checkpoint keys, and MoE experts held one Linear per expert."""

from __future__ import annotations

import json
import re

import pytest
import torch
from architectures import save_tiny
from safetensors import safe_open

import llmpress
from llmpress.errors import CheckpointError
from llmpress.models import LinearExperts, calibrating_all_experts, fused_experts, linearize_experts
from llmpress.modifiers import GPTQModifier


def _keys(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_linear_experts_compute_what_the_fused_module_does(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_tiny(model_type, tmp_path)).eval()
    ids = torch.randint(3, 4096, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        assert linearize_experts(model)
        after = model(ids).logits
    assert not list(fused_experts(model))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_per_expert_checkpoint_loads_as_transformers_loads_it(tmp_path):
    """Mixtral's checkpoint names experts block_sparse_moe.experts.<i>.w1 (transformers fuses them
    on load): llmpress reads it with the same logits, and writes it back in the same layout."""
    from transformers import AutoModelForCausalLM

    source = save_tiny("mixtral", tmp_path / "src")
    keys = _keys(source)
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys
    ids = torch.randint(3, 4096, (2, 12))
    reference = AutoModelForCausalLM.from_pretrained(source).eval()
    ours = llmpress.load(source)
    assert isinstance(ours.model.layers[0].mlp.experts, LinearExperts)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    llmpress.save_checkpoint(tmp_path / "again", ours)
    assert _keys(tmp_path / "again") == keys


def test_renamed_head_and_base_model_checkpoints_load(tmp_path):
    """GPT-NeoX stores its head as embed_out; a BertModel checkpoint has no 'bert.' prefix."""
    from transformers import AutoModel, AutoModelForCausalLM, BertForMaskedLM

    neox = save_tiny("gpt_neox", tmp_path / "neox")
    assert "embed_out.weight" in _keys(neox)
    ids = torch.randint(3, 4096, (1, 10))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(neox).eval()(ids).logits
        torch.testing.assert_close(llmpress.load(neox)(ids).logits, expected)

    bert = save_tiny("bert", tmp_path / "bert")
    assert not any(k.startswith("bert.") for k in _keys(bert))
    ours = llmpress.load(bert)
    assert type(ours).__name__ == "BertModel"  # the class config.architectures names
    with torch.no_grad():
        expected = AutoModel.from_pretrained(bert).eval()(ids).last_hidden_state
        torch.testing.assert_close(ours(ids).last_hidden_state, expected)
    # the same weights under a model with a head, as from_pretrained maps the prefix
    head = BertForMaskedLM(ours.config)
    head.save_pretrained(tmp_path / "with-head")
    with_head = llmpress.load(tmp_path / "with-head")
    assert type(with_head).__name__ == "BertForMaskedLM"


def test_incomplete_per_expert_checkpoint_is_still_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    source = save_tiny("qwen3_moe", tmp_path)
    state = load_file(str(source / "model.safetensors"))
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks weights") as error:
        llmpress.load(source)
    assert "experts.2.up_proj" in str(error.value)


def test_every_expert_gets_its_own_hessian_from_all_tokens(tmp_path):
    """calibrate_all_experts: each expert's projections see every calibration token, so none is
    left without statistics; the layer's output still uses only the routed experts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_tiny("qwen3_moe", tmp_path)).eval()
    linearize_experts(model)
    experts = model.model.layers[0].mlp.experts
    seen: dict[int, int] = {}
    hooks = [e.gate_proj.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, seen.get(i, 0) + a[0].shape[0]))
             for i, e in enumerate(experts)]
    ids = torch.randint(3, 4096, (2, 12))
    with torch.no_grad():
        routed = model(ids).logits
        routed_counts = dict(seen)
        seen.clear()
        with calibrating_all_experts(model):
            everyone = model(ids).logits
    for hook in hooks:
        hook.remove()
    assert sum(routed_counts.values()) == 24 * 2  # top-2 routing
    assert seen == {i: 24 for i in range(len(experts))}
    torch.testing.assert_close(everyone, routed)


def test_oneshot_quantizes_every_expert_of_a_transformers_moe_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_tiny("mixtral", tmp_path)).eval()
    samples = [torch.randint(3, 4096, (16,)).tolist() for _ in range(4)]
    llmpress.oneshot(model, GPTQModifier(scheme="W4A16", ignore=["lm_head"]), samples)
    experts = model.model.layers[1].mlp.experts
    assert all(hasattr(p, "weight_scale") for e in experts for p in (e.w1, e.w2, e.w3))


@pytest.mark.parametrize("model_free", [False, True])
def test_experts_under_their_own_config_group_load_in_transformers(tmp_path, model_free):
    """Int8 attention and int4 experts, each config group targeted by a pattern that does not say
    "experts": transformers 5 builds a block's experts as one module and takes their scheme from
    the group whose ``re:`` target names experts, else the first; it took the attention's int8
    group and failed. The save path names the experts' group as theirs."""
    from transformers import AutoModelForCausalLM

    from llmpress.modifiers import QuantizationModifier

    int_weights = {"type": "int", "symmetric": True}
    groups = {"attention": {"targets": [r"re:.*self_attn\.[qkvo]_proj$"], "weights": {**int_weights, "num_bits": 8, "strategy": "channel"}},
              "mlp": {"targets": [r"re:.*mlp\..*_proj$"], "weights": {**int_weights, "num_bits": 4, "strategy": "group", "group_size": 32}}}
    out = tmp_path / "out"
    samples = [torch.randint(3, 4096, (16,)).tolist() for _ in range(4)]
    llmpress.oneshot(str(save_tiny("qwen3_moe", tmp_path / "model")), QuantizationModifier(config_groups=groups, ignore=["lm_head"]),
                     samples, output_dir=out, return_model=False, model_free=model_free)  # layerwise: the attention's group first
    targets = [t for g in json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values() for t in g["targets"]]
    assert r"re:.*\.experts\.\d+\.(down_proj|gate_proj|up_proj)$" in targets
    ids = torch.randint(3, 4096, (1, 12))
    ours = llmpress.load(out, dtype=torch.float32, dequantize=True)(ids).logits
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert ((theirs - ours).norm() / ours.norm()) < 1e-4


def test_targets_by_module_path_also_name_the_checkpoints_paths(tmp_path):
    """transformers 5 holds Mixtral's experts as ``mlp.experts``; its checkpoint (and vLLM) says
    ``block_sparse_moe.experts``. A target by path (a mixed choice's block of experts, a module
    by name) gets the checkpoint's form beside the model's: vLLM matches one, transformers and
    llmpress.load the other."""
    from transformers import AutoModelForCausalLM

    from llmpress.checkpoint.compressed_state import _as_stored
    from llmpress.models.keys import KeyMap
    from llmpress.quant.presets import preset_scheme

    model = AutoModelForCausalLM.from_pretrained(save_tiny("mixtral", tmp_path / "model"))
    linearize_experts(model)
    experts = [n for n, _ in model.named_modules() if re.fullmatch(r"model\.layers\.\d\.mlp\.experts\.\d+\.w[123]", n)]
    block = preset_scheme("W4A16").model_copy(update={"targets": [r"re:model\.layers\.0\.mlp\.experts\.\d+\.(w1|w2|w3)$"]})
    other = preset_scheme("W8A16").model_copy(update={"targets": [r"re:model\.layers\.1\.mlp\.experts\.\d+\.(w1|w2|w3)$"]})
    attention = preset_scheme("W8A16").model_copy(update={"targets": ["model.layers.0.self_attn.q_proj", "Linear"]})
    named = [(n, block if ".layers.0." in n else other) for n in experts] + [("model.layers.0.self_attn.q_proj", attention)]
    stored = _as_stored(named, KeyMap(model))
    assert stored[0].targets == [*block.targets, r"re:model\.layers\.0\.block_sparse_moe\.experts\.\d+\.(w1|w2|w3)$"]
    assert stored[-1] is attention  # the same path in both: nothing to add


def test_experts_under_two_schemes_are_said_unreadable_by_transformers(caplog):
    """transformers reads one scheme for all of a model's experts: the save says so where they
    are under two, and names each scheme's experts as experts."""
    import logging

    from llmpress.checkpoint.compressed_state import name_experts
    from llmpress.quant.presets import preset_scheme

    w4, w8 = preset_scheme("W4A16"), preset_scheme("W8A16")
    experts = [f"model.layers.{layer}.mlp.experts.{e}.{p}" for layer in range(2) for e in range(2) for p in ("gate_proj", "down_proj")]
    with caplog.at_level(logging.WARNING):
        one = name_experts([(n, w4) for n in experts])
    assert "reads one scheme" not in caplog.text
    assert one[0].targets == ["Linear", r"re:.*\.experts\.\d+\.(down_proj|gate_proj)$"]
    with caplog.at_level(logging.WARNING):
        two = name_experts([(n, w4 if ".layers.0." in n else w8) for n in experts])
    assert "under 2 schemes" in caplog.text and "experts: shared" in caplog.text
    assert two[0].targets[-1] == r"re:model\.layers\.0\.mlp\.experts\.\d+\.(down_proj|gate_proj)$"
    assert two[-1].targets[-1] == r"re:model\.layers\.1\.mlp\.experts\.\d+\.(down_proj|gate_proj)$"


def test_a_recipes_linear_leaves_a_moe_router_dense(tmp_path):
    """Phi-MoE's router is a Linear subclass that reads its own ``weight``: quantized by the W4A16
    preset's ``Linear``, neither transformers ('PhimoeTopKRouter' object has no attribute
    'weight') nor llmpress.load read the file. ``Linear`` no longer reaches a router; a pattern
    still does."""
    from transformers import AutoModelForCausalLM

    from llmpress.modifiers import QuantizationModifier
    from llmpress.targets import assign_by_targets

    source = save_tiny("phimoe", tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    routers = {"model.layers.0.mlp.router", "model.layers.1.mlp.router"}
    assert not routers & set(assign_by_targets(model, [(["Linear"], None)], linear_alias=True))
    assert routers <= set(assign_by_targets(model, [(["Linear", "re:.*router$"], None)], linear_alias=True))
    assert routers <= set(assign_by_targets(model, [(["Linear"], None)]))  # a checkpoint's config reads as written
    out = tmp_path / "out"
    samples = [torch.randint(3, 4096, (16,)).tolist() for _ in range(4)]
    llmpress.oneshot(str(source), QuantizationModifier(scheme="W4A16", ignore=["lm_head"]), samples, output_dir=out, return_model=False)
    assert routers <= set(json.loads((out / "config.json").read_text())["quantization_config"]["ignore"])
    ids = torch.randint(3, 4096, (1, 12))
    ours = llmpress.load(out, dtype=torch.float32, dequantize=True)(ids).logits
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert ((theirs - ours).norm() / ours.norm()) < 1e-4
    # a file whose routers are quantized (a pattern named them): llmpress.load keeps the router's
    # class, which returns the routing, and gives it the dequantized weight, on either reader
    quantized = tmp_path / "routers"
    llmpress.oneshot(str(source), QuantizationModifier(scheme="W4A16", targets=["Linear", "re:.*router$"], ignore=["lm_head"]),
                     samples, output_dir=quantized, return_model=False)
    assert not routers & set(json.loads((quantized / "config.json").read_text())["quantization_config"]["ignore"])
    exact = llmpress.load(quantized, dtype=torch.float32, dequantize=True)
    kernels = llmpress.load(quantized, dtype=torch.float32)
    router = kernels.model.layers[0].mlp.router
    assert type(router).__name__ == "PhimoeTopKRouter" and router.weight.shape == (4, 128)
    torch.testing.assert_close(kernels(ids).logits, exact(ids).logits, rtol=1e-3, atol=1e-3)
    # other Linear subclasses with a forward of their own (Falcon's FalconLinear) still run on the kernels
    llmpress.oneshot(str(save_tiny("falcon", tmp_path / "falcon")), QuantizationModifier(scheme="W4A16", ignore=["lm_head"]),
                     samples, output_dir=tmp_path / "falcon-out", return_model=False, model_free=False)
    from llmpress.runtime import QuantizedLinear

    assert isinstance(llmpress.load(tmp_path / "falcon-out").transformer.h[0].self_attention.query_key_value, QuantizedLinear)


def test_hub_model_id_resolves_from_the_local_cache_offline(tmp_path, monkeypatch):
    """``Qwen/Qwen3-8B``-style ids resolve as from_pretrained resolves them: the cache first;
    HF_HUB_OFFLINE (set for every test) keeps it from going online."""
    import shutil

    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-qwen3-moe" / "snapshots" / "0123abcd"
    save_tiny("qwen3_moe", tmp_path / "src")
    shutil.copytree(tmp_path / "src", snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    model = llmpress.load("tiny-org/tiny-qwen3-moe")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    with pytest.raises(CheckpointError, match="neither a local folder nor in the Hugging Face cache"):
        llmpress.load("tiny-org/not-cached")
