"""Memory that stays bounded by a layer: kept activations spilled to a file, and a checkpoint
written from the held integers without rebuilding the model in float."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import GPTQ_W4_G32, checkpoint_tensors, make_tiny_llama, token_batches

import llmpress
from llmpress.data import CalibrationOptions
from llmpress.modifiers import GPTQModifier
from llmpress.pipelines.storage.compact import CompactWeights
from llmpress.pipelines.storage.kept import KeptValues

RECIPE = GPTQ_W4_G32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spilled_values_come_back_as_they_went(tmp_path, dtype):
    kept = KeptValues([8, 3, 5], spill=tmp_path)
    values = [torch.randn(2, 4, 16).to(dtype), (torch.randn(1, 3, 16).to(dtype), None), torch.randn(5, 16).to(dtype)]
    for index, value in enumerate(values):
        kept.put(index, value)
    assert kept.buffer is None  # nothing held in memory
    assert torch.equal(kept.get(0), values[0]) and torch.equal(kept.get(0), values[0])  # read twice
    first, rest = kept.get(1)
    assert torch.equal(first, values[1][0]) and rest is None
    taken = kept.take(2)
    assert torch.equal(taken, values[2]) and kept.items[2] is None
    odd = KeptValues([4], spill=tmp_path)
    odd.put(0, ("not a tensor", 1))  # kept as it is
    assert odd.get(0) == ("not a tensor", 1)


def test_spilling_changes_nothing_in_the_result(tmp_path):
    model = make_tiny_llama(intermediate=256)
    model.save_pretrained(tmp_path / "model")
    for spill in (True, False):
        options = CalibrationOptions(num_samples=None, seq_len=32, batch_size=2, true_sequential=True, spill_activations=spill)
        llmpress.oneshot(str(tmp_path / "model"), RECIPE, token_batches(count=6), output_dir=tmp_path / f"out-{spill}",
                         calibration=options)
    one, two = checkpoint_tensors(tmp_path / "out-True"), checkpoint_tensors(tmp_path / "out-False")
    assert all(torch.equal(one[k], two[k]) for k in one)


#: GPTQ's scheme -> whether the save packs the held integers as they are (integer schemes, the
#: zero point added by channel or whole groups, and fp8), or rebuilds each weight in float first
#: (fp4's own rounding)
HELD_RECIPES = {"W4A16 g32": True, "W8A16": True, "W8A8": True, "FP8": True, "W4A16 asym g32": True, "W8 asym channel": True,
                "W4A16_ASYM": True, "NVFP4": False}

ASYMMETRIC = {"W4A16 asym g32": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
              "W8 asym channel": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}}


@pytest.mark.parametrize("scheme", list(HELD_RECIPES))
def test_the_checkpoint_is_written_from_the_held_integers(tmp_path, monkeypatch, scheme):
    """``return_model=False`` (the command line): the finished layers are never rebuilt whole in
    float, and the checkpoint is the one a run that returns the model writes."""
    recipe = (RECIPE if scheme == "W4A16 g32" else GPTQModifier(scheme=scheme, ignore=["lm_head"]) if scheme not in ASYMMETRIC
              else GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": ASYMMETRIC[scheme]}}, ignore=["lm_head"]))
    model = make_tiny_llama(intermediate=256)
    model.save_pretrained(tmp_path / "model")
    options = CalibrationOptions(num_samples=None, seq_len=32, batch_size=2)
    kept = llmpress.oneshot(str(tmp_path / "model"), recipe, token_batches(count=6), output_dir=tmp_path / "returned",
                            calibration=options)
    assert kept is not None
    restored, rebuilt = [], []
    monkeypatch.setattr(CompactWeights, "restore", lambda self: restored.append(self))
    weight_of = CompactWeights.weight_of
    monkeypatch.setattr(CompactWeights, "weight_of", lambda self, *a, **k: rebuilt.append(1) or weight_of(self, *a, **k))
    assert llmpress.oneshot(str(tmp_path / "model"), recipe, token_batches(count=6), output_dir=tmp_path / "held",
                            calibration=options, return_model=False) is None
    assert not restored and (not rebuilt) == HELD_RECIPES[scheme]
    one, two = checkpoint_tensors(tmp_path / "returned"), checkpoint_tensors(tmp_path / "held")
    assert one.keys() == two.keys()
    assert all(one[k].dtype == two[k].dtype and torch.equal(one[k].view(torch.uint8), two[k].view(torch.uint8)) for k in one)
    if scheme != "W4A16 g32":
        return
    dense = llmpress.oneshot(str(tmp_path / "model"), RECIPE, token_batches(count=6), output_dir=tmp_path / "dense",
                             calibration=options, return_model=False, save_compressed=False)
    assert dense is None
    weights = checkpoint_tensors(tmp_path / "dense")
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    assert not any(t.is_meta for t in weights.values())


def test_spill_files_are_written_over_by_the_next_stage(tmp_path):
    """A finished KeptValues gives its file back; the next one in that folder writes over it
    (pages the file cache holds already), and the run's end closes them."""
    from llmpress.pipelines.storage import kept as kept_module

    first = KeptValues([4], spill=tmp_path)
    first.put(0, torch.randn(4, 8))
    file = first._file
    del first
    second = KeptValues([2], spill=tmp_path)
    value = torch.randn(2, 8)
    second.put(0, value)
    assert second._file is file and torch.equal(second.get(0), value)
    del second
    kept_module.close_spill_files()
    assert file.closed


def test_a_quantized_weight_takes_the_place_of_a_mapped_one():
    """``replace_weight``: a fresh result becomes the weight (no write into a copy-on-write
    mapping); one module's rows of a stacked result are copied out, sharing nothing."""
    from llmpress.lifecycle.attach import replace_weight

    first, second = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4, bias=False)
    parameter = first.weight
    stacked = torch.randn(8, 8)
    replace_weight(first, stacked[:4])
    replace_weight(second, stacked[4:])
    assert first.weight is parameter  # the same Parameter, new data
    assert torch.equal(first.weight, stacked[:4]) and torch.equal(second.weight, stacked[4:])
    assert first.weight.untyped_storage().data_ptr() != stacked.untyped_storage().data_ptr()
    fresh = torch.randn(4, 8)
    replace_weight(first, fresh)
    assert first.weight.data_ptr() == fresh.data_ptr()  # handed over, not copied
    half = torch.nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    replace_weight(half, fresh)
    assert half.weight.dtype == torch.bfloat16 and torch.equal(half.weight, fresh.to(torch.bfloat16))


def test_spilled_block_inputs_behave_as_a_list(tmp_path):
    """A block's inputs with their hidden states in a file: read, set, sliced and replaced as the
    pipeline and the modifiers use a list, with the other arguments kept as they were."""
    from llmpress.contract.block import tokens_per_batch
    from llmpress.pipelines.storage.kept import SpilledInputs

    rotary = torch.randn(1, 4, 8)
    items = [((torch.randn(1, 4, 16),), {"position_embeddings": rotary}),
             ((), {"hidden_states": torch.randn(2, 4, 16), "mask": None})]
    inputs = SpilledInputs([4, 8], spill=tmp_path)
    inputs.extend(items)
    assert len(inputs) == 2 and inputs.values.buffer is None  # nothing held in memory
    assert torch.equal(inputs[0][0][0], items[0][0][0]) and inputs[0][1]["position_embeddings"] is rotary
    assert torch.equal(inputs[-1][1]["hidden_states"], items[1][1]["hidden_states"]) and inputs[1][1]["mask"] is None
    assert tokens_per_batch(inputs) == [4, 8]
    replaced = torch.randn(2, 4, 16)
    inputs[1] = ((), {"hidden_states": replaced, "mask": None})
    assert torch.equal(inputs[1][1]["hidden_states"], replaced)
    assert [torch.equal(a[0], b[0][0]) for a, b in zip([args for args, _ in inputs[:1]], items)] == [True]
    inputs[:] = items[:1]
    assert len(inputs) == 1 and torch.equal(inputs[0][0][0], items[0][0][0])
    with pytest.raises(IndexError):
        inputs[3]
    inputs.clear()
    assert len(inputs) == 0


def _recipes():
    from llmpress.modifiers import AWQModifier, GPTQModifier, SmoothQuantModifier, SparseGPTModifier

    return {"gptq": RECIPE, "awq": [AWQModifier(ignore=["lm_head"], scheme="W4A16", targets=["Linear"])],
            "smoothquant": [SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head"])],
            "sparsegpt": [SparseGPTModifier(sparsity=0.5, mask_structure="2:4", ignore=["lm_head"])]}


@pytest.mark.parametrize("name", ["gptq", "awq", "smoothquant", "sparsegpt"])
def test_calibration_leaves_no_activations_to_the_garbage_collector(name):
    """What a layer's calibration made goes back when it is done, by reference counting: a
    reference cycle (a recursive closure held the block's probe, every submodule's output for a
    batch) kept it until the collector ran, at a different layer each time."""
    model = make_tiny_llama(intermediate=256)
    recipe = _recipes()[name]
    batches = token_batches(count=4)
    options = CalibrationOptions(num_samples=None, seq_len=32, batch_size=2, true_sequential=True)
    gc.collect()
    gc.disable()
    try:
        llmpress.oneshot(model, recipe, batches, calibration=options)
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds stays in gc.garbage, to be looked at
        gc.collect()
        found = [tuple(o.shape) for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert found == []
