"""Training modifiers on an FSDP2 (``fully_shard``) model, two real ranks on gloo: masks decided on
the whole weight and applied to each rank's shard, and one checkpoint gathered and written by
rank 0 (``unwrap_if_fsdp``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from helpers import REPO, checkpoint_tensors, gloo_rank, make_tiny_llama, text_path, token_batches, trained_model_dir

from llmpress.errors import CheckpointError

PRUNE = """
pruning_stage:
  pruning_modifiers:
    MagnitudePruningModifier:
      targets: ["re:.*_proj$"]
      init_sparsity: 0.1
      final_sparsity: 0.5
      start: 0.0
      end: 0.5
      update: 0.25
"""


def _sharded_tiny_llama(world: int, samples: int, recipe: str, epochs: int):
    """A tiny Llama, each layer and the whole sharded over ``world`` ranks, trained ``epochs``
    over this rank's share of ``samples`` under ``recipe``; returns it and its batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import llmpress
    from llmpress.parallel.distributed import share_of

    model = make_tiny_llama(intermediate=256)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batches = share_of([torch.tensor([ids]) for ids in token_batches(count=samples, length=32)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with llmpress.Session(recipe) as session:
        session.initialize(model=model, optimizer=optimizer, steps_per_epoch=len(batches))
        for _ in range(epochs):
            for batch in batches:
                with session.training_step() as step:
                    step.loss(model(input_ids=batch, labels=batch).loss).backward()
                    step.optimizer_step(optimizer)
                    optimizer.zero_grad()
        session.finalize()
    return model, batches


def _train_rank(rank: int, world: int, init: str, folder: str) -> None:
    with gloo_rank(rank, world, init):
        import llmpress
        from llmpress.parallel.fsdp import is_dtensor

        model, batches = _sharded_tiny_llama(world, samples=8, recipe=PRUNE, epochs=2)
        llmpress.save_checkpoint(folder, model)
        # a Trainer's save under FSDP: the state dict gathered on every rank, save_pretrained on the main one
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        model.save_pretrained(folder + "-trainer", state_dict=gathered, is_main_process=rank == 0)
        torch.distributed.barrier()
        # the model is sharded again after the saves, and still trains
        assert is_dtensor(model.model.layers[0].mlp.down_proj.weight)
        model(input_ids=batches[0], labels=batches[0]).loss.backward()


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    work = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_train_rank, args=(2, f"file://{work / 'rendezvous'}", str(work / "pruned")), nprocs=2, join=True)
    return work / "pruned"


def test_fsdp_pruning_reaches_the_global_sparsity_in_every_linear(fsdp_checkpoint):
    tensors = checkpoint_tensors(fsdp_checkpoint)
    pruned = {k: v for k, v in tensors.items() if k.endswith("_proj.weight")}
    assert len(pruned) == 14
    for name, weight in pruned.items():  # the whole weight's share of zeros, not each shard's
        assert (weight == 0).sum().item() == round(0.5 * weight.numel()), name
    assert (tensors["lm_head.weight"] != 0).all()
    record = json.loads((fsdp_checkpoint / "config.json").read_text())["llmpress_sparsity"]
    assert record["sparsity_structure"] == "unstructured"


def test_a_trainers_gathered_state_dict_saves_the_same_checkpoint(fsdp_checkpoint):
    """What transformers' Trainer does under FSDP: gather, then save_pretrained(state_dict=...,
    is_main_process=...) on the main rank alone."""
    ours = checkpoint_tensors(fsdp_checkpoint)
    trainer = checkpoint_tensors(fsdp_checkpoint.with_name(fsdp_checkpoint.name + "-trainer"))
    assert ours.keys() == trainer.keys() and all(torch.equal(ours[k], trainer[k]) for k in ours)


def test_the_fsdp_checkpoint_loads_in_transformers(fsdp_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fsdp_checkpoint)
    assert (model.model.layers[1].self_attn.q_proj.weight == 0).float().mean().item() == pytest.approx(0.5, abs=0.01)


def test_a_sharded_model_saved_by_one_rank_needs_the_gathered_state(monkeypatch, tmp_path):
    import llmpress
    from llmpress.checkpoint import save as save_module

    monkeypatch.setattr(save_module, "is_sharded", lambda model: True)
    with pytest.raises(CheckpointError, match="saved by one rank alone"):
        llmpress.save_checkpoint(tmp_path / "out", make_tiny_llama(), synchronize=False)


@pytest.mark.parametrize("teacher", ["replicated", "sharded"])
def test_the_fsdp_example_runs_on_two_ranks(tmp_path, teacher):
    """``torchrun --nproc-per-node 2 examples/prune_fsdp.py`` on the trained model (a short run),
    the distillation teacher whole on every rank or sharded too: 50% in every pruned Linear of
    the one checkpoint rank 0 writes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO / "examples" / "prune_fsdp.py"), "--model", str(trained_model_dir()), "--text", str(text_path("calibration.txt")),
               "--output", str(tmp_path / "out"), "--max-samples", "16", "--seq-len", "64", "--batch-size", "2", "--max-windows", "2"]
    command += ["--shard-teacher"] if teacher == "sharded" else []
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("pruned (checkpoint)") == 1  # the main rank reports
    assert "50.0% .. 50.0%" in done.stdout and "28 pruned modules" in done.stdout, done.stdout[-600:]
    tensors = checkpoint_tensors(tmp_path / "out")
    pruned = [name for name in tensors if name.endswith("_proj.weight")]
    assert pruned
    for name in pruned:
        assert abs((tensors[name] == 0).float().mean().item() - 0.5) <= 0.01, name


QAT_PER_TENSOR = """
qat_stage:
  qat_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 8, type: int, symmetric: true, strategy: tensor}
"""


def _qat_rank(rank: int, world: int, init: str, folder: str) -> None:
    with gloo_rank(rank, world, init):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        import llmpress
        from llmpress.parallel.distributed import gather_objects

        model, _ = _sharded_tiny_llama(world, samples=4, recipe=QAT_PER_TENSOR, epochs=1)
        scales = {n: m.weight_scale.item() for n, m in model.named_modules() if hasattr(m, "weight_scale")}
        assert len(scales) == 14 and all(s == scales for s in gather_objects(scales))  # one scale: the whole weight's
        whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        llmpress.save_checkpoint(folder, model)
        if rank == 0:
            torch.save({"scales": scales, "weights": {k: v for k, v in whole.items() if k.endswith("_proj.weight")}},
                       folder + "-expected.pt")


def test_qat_under_fsdp_quantizes_the_whole_weight(tmp_path):
    """Per-tensor QAT on sharded weights: every rank freezes onto the grid of the whole weight
    (one scale, the same on every rank), and the one checkpoint holds exactly those weights."""
    import llmpress

    mp.spawn(_qat_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path / "qat")), nprocs=2, join=True)
    expected = torch.load(tmp_path / "qat-expected.pt", weights_only=True)
    loaded = dict(llmpress.load(tmp_path / "qat").named_modules())
    for key, weight in expected["weights"].items():
        name = key.removesuffix(".weight")
        scale = expected["scales"][name]
        steps = weight / scale
        assert (steps - steps.round()).abs().max() < 1e-3 and steps.abs().max() <= 128, key  # the whole weight's grid
        assert torch.allclose(loaded[name].dequantized_weight(), weight, rtol=0, atol=scale * 1e-3), key
