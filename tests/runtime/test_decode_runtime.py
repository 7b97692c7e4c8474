"""What ``llmpress.load`` sets up for decoding: fused int4 products for layers that read the same
input, and ``generate()`` through a compiled step with a static cache."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from helpers import make_tiny_llama

import llmpress
from llmpress.runtime import QuantizedLinear
from llmpress.runtime.decode import COMPILE_AFTER_TOKENS, can_compile, compiles, is_compiled
from llmpress.runtime.fusion import fuse_projections, unfuse

pytestmark = pytest.mark.skipif(not llmpress.native.available(), reason="llmpress's int4 operator does not build here")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    model = make_tiny_llama(intermediate=256)
    model.save_pretrained(folder)
    return folder


def _load(folder, compile_decode=False, **config):
    return llmpress.load(folder, quantization_config=llmpress.LlmpressConfig(bits=4, **config), compile_decode=compile_decode)


def _members(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear) and m._fusion is not None}


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_reading_one_input_run_as_one_product_with_the_same_results(tiny_dir, symmetric, dtype):
    model = _load(tiny_dir, symmetric=symmetric).to(dtype)
    fuse_projections(model)  # .to() dissolves the groups load() made
    fused = _members(model)
    groups = {id(m._fusion[0]) for m in fused.values()}
    assert len(groups) == 4 and len(fused) == 10  # per layer: q/k/v and gate/up; o_proj and down_proj read their own inputs
    first = model.model.layers[0]
    assert first.self_attn.q_proj._fusion[0] is first.self_attn.v_proj._fusion[0] is not first.mlp.up_proj._fusion[0]
    # the members' tensors are views of the fused ones: no second copy
    group = first.mlp.gate_proj._fusion[0]
    assert first.mlp.up_proj.int4_weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    weights = {name: m.dequantized_weight(torch.float32) for name, m in fused.items()}
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outputs = [model(ids[:, :1]).logits, model(ids).logits]  # decode and prefill products
        unfuse(model)
        assert not _members(model)
        reference = [model(ids[:, :1]).logits, model(ids).logits]
    for got, want in zip(outputs, reference):
        assert torch.equal(got, want)
    for name, module in model.named_modules():
        if name in weights:
            assert torch.equal(module.dequantized_weight(torch.float32), weights[name])


def test_a_member_called_on_another_input_computes_its_own_rows(tiny_dir):
    model = _load(tiny_dir)
    attention = model.model.layers[0].self_attn
    assert attention.k_proj._fusion is not None
    x, y = torch.randn(1, 3, 128), torch.randn(1, 3, 128)
    with torch.no_grad():
        q, k_other, v = attention.q_proj(x), attention.k_proj(y), attention.v_proj(x)
        group = attention.q_proj._fusion[0]
        assert group.kept[0] is x and group.kept[2] == {0, 2}  # k_proj computed its own rows alone
        q_again = attention.q_proj(x)  # called again: a new round
        assert group.kept[2] == {0} and torch.equal(q_again, q)
        unfuse(model)
        assert torch.equal(q, attention.q_proj(x)) and torch.equal(k_other, attention.k_proj(y)) and torch.equal(v, attention.v_proj(x))


def test_saving_a_fused_model_writes_what_an_unfused_one_writes(tiny_dir, tmp_path):
    model = _load(tiny_dir)
    assert _members(model)
    model.save_pretrained(tmp_path / "fused")
    unfuse(model)
    model.save_pretrained(tmp_path / "plain")
    from safetensors.torch import load_file

    fused, plain = load_file(tmp_path / "fused" / "model.safetensors"), load_file(tmp_path / "plain" / "model.safetensors")
    assert fused.keys() == plain.keys() and all(torch.equal(fused[k], plain[k]) for k in plain)


def test_copies_run_unfused_and_casts_keep_the_groups(tiny_dir):
    model = _load(tiny_dir)
    clone = copy.deepcopy(model)
    assert _members(model) and not _members(clone)
    ids = torch.randint(0, 512, (1, 5))
    with torch.no_grad():
        # the blocks' outputs: fused and unfused agree to the bit. (Not the logits: the dense
        # lm_head is read memory-mapped at the file's alignment, the copy's is 64-byte aligned,
        # and the BLAS sums in another order)
        assert torch.equal(clone.model(ids[:, :1]).last_hidden_state, model.model(ids[:, :1]).last_hidden_state)
        model.float()
        model.to(torch.bfloat16)  # the int4 buffers stay where they are: still fused
        assert _members(model)
        first = model.model.layers[0].mlp.up_proj
        first.load_quantized(first.quantized_values(), first.weight_scale)  # new values: its group runs unfused
        assert first._fusion is None and model.model.layers[0].mlp.gate_proj._fusion is None
        assert model.model.layers[0].self_attn.q_proj._fusion is not None


def test_a_layer_read_on_two_inputs_joins_one_group_only(tiny_dir):
    """A block run twice (shared weights) sees its layers on two inputs: one group each."""
    model = _load(tiny_dir)
    layers = model.model.layers
    layers[1] = layers[0]  # the same block twice
    groups = fuse_projections(model)
    members = [m for g in groups for m in g.members]
    assert len(members) == len(set(map(id, members))) == 5


def test_load_compiles_generate_once_it_pays_and_keeps_what_generate_does(tiny_dir, monkeypatch):
    """By default the decode step compiles once the model has generated enough tokens; then a
    static cache and a compiled step give the greedy tokens of eager decoding; sampling, stopping
    criteria and batches of two work; the model's generation config is untouched."""
    model = _load(tiny_dir, compile_decode=None)
    assert compiles(model) == can_compile(model)
    if not compiles(model):
        pytest.skip("torch.compile has no C++ compiler here")
    assert model.generate.after_tokens == COMPILE_AFTER_TOKENS
    model.generate.after_tokens = 40  # a smaller threshold for the test
    ids = torch.randint(1, 512, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second prompt is left-padded
    settings = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    with torch.no_grad():
        eager = model.generate(ids, do_sample=False, **settings)  # 24 tokens generated: not yet
        assert not is_compiled(model) and not model.generate._compiled
        compiled = model.generate(ids, do_sample=False, **settings)  # 48: compiles
        assert is_compiled(model) and "_compiled_call" in model.generate._compiled  # transformers' compiled forward ran the steps
        assert torch.equal(compiled, eager)
        torch.manual_seed(0)
        sampled = model.generate(ids, do_sample=True, top_k=20, **settings)
        stopped = model.generate(ids, do_sample=False, stopping_criteria=[lambda input_ids, scores, **kw: torch.full((2,), input_ids.shape[1] >= 9)],
                                 **{**settings, "min_new_tokens": 0})
    assert sampled.shape == compiled.shape and stopped.shape[1] == 9
    assert model.generation_config.cache_implementation is None and model.generation_config.compile_config is None
    assert model._previous_max_cache_length == 256  # 17 positions, rounded up: other prompts reuse the compiled step
    clone = copy.deepcopy(model)  # its generate() is bound to the copy, not to the original
    assert compiles(clone) and clone.generate.model is clone and clone.generate.after_tokens == 40
    assert "_compiled_call" not in vars(model) and not clone.generate._compiled  # the compiled forward stays with the original
    with torch.no_grad():
        clone.lm_head.weight.data.mul_(-1)  # another model now: its greedy tokens differ
        assert not torch.equal(clone.generate(ids, do_sample=False, **settings), compiled)
    pickle.dumps(model)  # compiled, it still pickles
    fresh = pickle.loads(pickle.dumps(_load(tiny_dir, compile_decode=True)))  # (a compiled forward itself does not pickle)
    assert compiles(fresh) and fresh.generate.model is fresh and fresh.generate.after_tokens == 0
    monkeypatch.setenv("LLMPRESS_COMPILE", "0")
    assert not can_compile(model) and not compiles(_load(tiny_dir, compile_decode=None))


@pytest.mark.parametrize("setting", [{"disable_compile": True}, {"cache_implementation": "dynamic"}, {"use_cache": False}])
def test_the_models_own_generation_config_is_honoured(tiny_dir, setting):
    """A model whose generation config turns compiling off, asks for another cache or for no
    cache decodes as transformers would, with nothing compiled."""
    model = _load(tiny_dir, compile_decode=True)
    for key, value in setting.items():
        setattr(model.generation_config, key, value)
    with torch.no_grad():
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert compiles(model) and not is_compiled(model)


def test_reading_sets_up_nothing_for_inference_and_load_does(tiny_dir, tmp_path, monkeypatch):
    """``read_checkpoint`` (what oneshot, train, eval and inspect use) neither fuses nor wraps
    ``generate``; ``llmpress.load`` does both, on the same checkpoint."""
    from llmpress.loading import read_checkpoint
    from llmpress.loading.loader import read_model_and_processor

    monkeypatch.setenv("LLMPRESS_COMPILE", "1")
    config = llmpress.LlmpressConfig(bits=4)
    read = read_checkpoint(tiny_dir, quantization_config=config)
    assert not _members(read) and not compiles(read) and "generate" not in vars(read)
    loaded = llmpress.load(tiny_dir, quantization_config=config, compile_decode=True)
    assert _members(loaded) and compiles(loaded)
    loaded.save_pretrained(tmp_path / "int4")
    dense, _ = read_model_and_processor(tmp_path / "int4")
    assert not compiles(dense) and "generate" not in vars(dense)
    done = llmpress.oneshot(str(tiny_dir), "W8A16", None)  # data-free: oneshot reads its model, nothing more
    assert not compiles(done) and "generate" not in vars(done)
