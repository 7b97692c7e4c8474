"""Memory that stays bounded by a layer: kept activations spilled to a file, and a checkpoint
written from the held integers without rebuilding the model in float."""

from __future__ import annotations

import pytest
import torch
from conftest import checkpoint_tensors, make_tiny_llama, token_batches

import llmpress
from llmpress.data import CalibrationOptions
from llmpress.pipelines.kept import KeptValues
from llmpress.quant.compact import CompactWeights

RECIPE = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}
"""


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


def test_the_checkpoint_is_written_from_the_held_integers(tmp_path, monkeypatch):
    """``return_model=False`` (the command line): the finished layers are never rebuilt whole in
    float, and the checkpoint is the one a run that returns the model writes."""
    model = make_tiny_llama(intermediate=256)
    model.save_pretrained(tmp_path / "model")
    options = CalibrationOptions(num_samples=None, seq_len=32, batch_size=2)
    kept = llmpress.oneshot(str(tmp_path / "model"), RECIPE, token_batches(count=6), output_dir=tmp_path / "returned",
                            calibration=options)
    assert kept is not None
    restored = []
    monkeypatch.setattr(CompactWeights, "restore", lambda self: restored.append(self))
    assert llmpress.oneshot(str(tmp_path / "model"), RECIPE, token_batches(count=6), output_dir=tmp_path / "held",
                            calibration=options, return_model=False) is None
    assert not restored
    one, two = checkpoint_tensors(tmp_path / "returned"), checkpoint_tensors(tmp_path / "held")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    dense = llmpress.oneshot(str(tmp_path / "model"), RECIPE, token_batches(count=6), output_dir=tmp_path / "dense",
                             calibration=options, return_model=False, save_compressed=False)
    assert dense is None
    weights = checkpoint_tensors(tmp_path / "dense")
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    assert not any(t.is_meta for t in weights.values())
