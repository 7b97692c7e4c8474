"""Rotations a reader applies at run time (QuIP, SpinQuant's R4): compressed-tensors' meaning of
a ``transform_config``, what a save writes, what ``llmpress.load`` reads back (llm-compressor's
layout: a shared matrix stored once), and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import checkpoint_tensors, logits, make_tiny_llama, token_batches

import llmpress
from llmpress.contract.observation import Observation
from llmpress.errors import CheckpointError, RecipeError
from llmpress.loading.inspect import describe_checkpoint
from llmpress.modifiers import GPTQModifier, QuantizationModifier, QuIPModifier, SpinQuantModifier
from llmpress.transforms.apply import GroupMatrices, apply_group
from llmpress.transforms.config import TransformConfig
from llmpress.transforms.online import online_transforms

W4 = {"scheme": "W4A16", "targets": ["Linear"], "ignore": ["lm_head"]}
QUIP = {"config_groups": {
    "v": {"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "input", "ignore": ["lm_head"]},
                                        {"targets": ["Linear"], "location": "weight_input", "inverse": True, "ignore": ["lm_head"]}]},
    "u": {"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "weight_output", "ignore": ["lm_head"]},
                                        {"targets": ["Linear"], "location": "output", "inverse": True, "ignore": ["lm_head"]}]}}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_a_transform_config_means_here_what_it_means_in_compressed_tensors():
    """Deterministic Hadamard matrices (powers of two, built alike by both): compressed-tensors'
    own ``apply_transform_config`` and llmpress's give the same weights and the same outputs,
    and both keep the model's function."""
    transform = pytest.importorskip("compressed_tensors.transform")
    theirs, ours = make_tiny_llama(intermediate=256), make_tiny_llama(intermediate=256)
    ids = torch.tensor(token_batches(2, 16, seed=3))
    reference = logits(ours, ids)
    transform.apply_transform_config(theirs, transform.TransformConfig.model_validate(QUIP))
    config = TransformConfig.model_validate(QUIP)
    for group, scheme in config.config_groups.items():
        apply_group(group, scheme, list(ours.named_modules()), GroupMatrices(scheme, 0), ours)
    mine = dict(ours.named_parameters())
    for name, parameter in theirs.named_parameters():
        if name in mine:  # every weight (their rotation matrices are parameters, ours buffers)
            assert torch.allclose(parameter, mine[name], atol=1e-6), name
    assert _rel(logits(theirs, ids), reference) < 1e-5 and _rel(logits(ours, ids), reference) < 1e-5
    assert len(online_transforms(ours)) == 2 * 2 * 7  # v and u on every Linear of two layers


@pytest.mark.parametrize("rotations", [["v"], ["v", "u"]])
def test_quip_round_trip_stores_each_matrix_once_and_loads_back_exactly(rotations, tmp_path):
    model = make_tiny_llama()
    ids = torch.tensor(token_batches(2, 16, seed=3))
    reference = logits(model, ids)
    out = tmp_path / "quip"
    compressed = llmpress.oneshot(model, [QuIPModifier(rotations=rotations), QuantizationModifier(**W4)], token_batches(8, 32),
                                  output_dir=out)
    in_memory = logits(compressed, ids)
    assert _rel(in_memory, reference) < 0.5  # 4-bit weights of a random model: near, not equal
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert sorted(config["transform_config"]["config_groups"]) == sorted(rotations)
    stored = [k for k in checkpoint_tensors(out) if "_input." in k or "_output." in k]
    # one matrix per (group, size): v on inputs of 128 and 200 columns, u on outputs of 128, 64 and 200 rows
    assert len(stored) == (2 if rotations == ["v"] else 5), stored
    described = describe_checkpoint(out)["rotations"]
    assert len(described) == len(rotations) and all("at run time" in line for line in described)
    assert all(g["type"] == "hadamard" or g["type"] == "random-hadamard" for g in config["transform_config"]["config_groups"].values())
    for dequantize in (True, False):
        loaded = llmpress.load(out, dtype=torch.float32, dequantize=dequantize, compile_decode=False)
        assert _rel(logits(loaded, ids), in_memory) < (1e-6 if dequantize else 1e-3)
    again = tmp_path / "again"  # a loaded checkpoint saves the same rotations again
    llmpress.save_checkpoint(again, llmpress.load(out, dtype=torch.float32, compile_decode=False))
    assert json.loads((again / "config.json").read_text())["quantization_config"]["transform_config"] == config["transform_config"]
    assert _rel(logits(llmpress.load(again, dtype=torch.float32, dequantize=True), ids), in_memory) < 1e-6
    # in bf16, every module of one stored matrix reads one float32 T, made once (not per call)
    bf16 = llmpress.load(out, dtype=torch.bfloat16, dequantize=True, compile_decode=False)
    logits(bf16, ids), logits(bf16, ids)
    caches = {id(m.shared): m.shared for _, m in online_transforms(bf16)}
    assert len(caches) == len(stored) and all(len(c.made) == 1 for c in caches.values())
    assert all(t.dtype == torch.float32 for c in caches.values() for t in c.made.values())


def test_r4_with_gptq_w8a8_observes_rotated_inputs_and_round_trips(tmp_path):
    model = make_tiny_llama()
    ids = torch.tensor(token_batches(2, 16, seed=3))
    out = tmp_path / "r4"
    compressed = llmpress.oneshot(model, [SpinQuantModifier(rotations=["R1", "R2", "R4"], transform_type="random-hadamard"),
                                          GPTQModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head"])],
                                  token_batches(8, 32), output_dir=out)
    down = compressed.model.layers[1].mlp.down_proj
    assert hasattr(down, "R4_input") and not hasattr(compressed.model.layers[1].mlp.up_proj, "R4_input")
    config = json.loads((out / "config.json").read_text())["quantization_config"]["transform_config"]
    assert list(config["config_groups"]) == ["R4"]  # R1 and R2 are folded: nothing for a reader to do
    loaded = llmpress.load(out, dtype=torch.float32, dequantize=True)
    assert _rel(logits(loaded, ids), logits(compressed, ids)) < 1e-6


def test_an_observer_registered_after_a_rotation_sees_the_rotated_input():
    model = make_tiny_llama()
    scheme = TransformConfig.model_validate(QUIP).config_groups["v"]
    apply_group("v", scheme, list(model.named_modules()), GroupMatrices(scheme, 0))
    linear = model.model.layers[0].mlp.down_proj
    seen = []

    class Spy(QuantizationModifier):
        def calibration_targets(self):
            return {"down": linear}

        def observe(self, name, x):
            seen.append(x)

    observation = Observation([Spy(**W4)])
    x = torch.randn(3, linear.in_features)
    linear(x)
    assert torch.allclose(seen[0], linear.v_input(x)) and not torch.allclose(seen[0], x)
    observation.remove()


def test_refusals_say_why(tmp_path):
    with pytest.raises(RecipeError, match="online rotation"):
        SpinQuantModifier(rotations=["R1", "R3"])
    with pytest.raises(RecipeError, match="randomize"):
        QuIPModifier(randomize=True)
    with pytest.raises(RecipeError, match="tied"):  # the head shares the embeddings' weight
        llmpress.oneshot(make_tiny_llama(tie=True), [QuIPModifier(ignore=[]), QuantizationModifier(**W4)], token_batches(2, 32))
    rotated = llmpress.oneshot(make_tiny_llama(), [QuIPModifier()], token_batches(2, 32))
    with pytest.raises(CheckpointError, match="nothing in it is quantized"):
        llmpress.save_checkpoint(tmp_path / "plain", rotated)
    assert not (tmp_path / "plain").exists()


def test_rotations_of_queries_and_keys_are_skipped_at_full_precision_and_refused_before_an_fp8_cache(tmp_path):
    out = tmp_path / "r3"
    llmpress.oneshot(make_tiny_llama(), [SpinQuantModifier(rotations=["R4"]), QuantizationModifier(**W4)], token_batches(4, 32),
                     output_dir=out)
    ids = torch.tensor(token_batches(2, 16, seed=3))
    before = logits(llmpress.load(out, dtype=torch.float32, dequantize=True), ids)
    path = out / "config.json"
    config = json.loads(path.read_text())
    r3 = {"type": "hadamard", "head_dim": 32, "apply": [{"targets": ["re:.*self_attn$"], "location": "q_attn"},
                                                       {"targets": ["re:.*self_attn$"], "location": "k_cache"}]}
    config["quantization_config"]["transform_config"]["config_groups"]["R3"] = r3
    path.write_text(json.dumps(config))
    assert torch.equal(logits(llmpress.load(out, dtype=torch.float32, dequantize=True), ids), before)
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                                        "symmetric": True}
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantized KV cache"):
        llmpress.load(out, dtype=torch.float32)


def test_a_hadamard_group_of_an_order_other_than_a_power_of_two_is_written_as_stored_matrices(tmp_path):
    """vLLM's GPU kernel builds a ``hadamard`` group's matrix itself (Sylvester's, 2^k only):
    llmpress's Paley orders are written ``random-hadamard``, whose stored matrix every reader reads."""
    out = tmp_path / "r4"
    llmpress.oneshot(make_tiny_llama(intermediate=192), [SpinQuantModifier(rotations=["R4"]), QuantizationModifier(**W4)],
                     token_batches(4, 32), output_dir=out)  # 192 = 12 x 16
    assert json.loads((out / "config.json").read_text())["quantization_config"]["transform_config"]["config_groups"]["R4"]["type"] \
        == "random-hadamard"
    power = tmp_path / "pow2"
    llmpress.oneshot(make_tiny_llama(intermediate=256), [SpinQuantModifier(rotations=["R4"]), QuantizationModifier(**W4)],
                     token_batches(4, 32), output_dir=power)
    assert json.loads((power / "config.json").read_text())["quantization_config"]["transform_config"]["config_groups"]["R4"]["type"] \
        == "hadamard"
