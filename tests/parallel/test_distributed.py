"""Calibration on several ranks (torch.distributed, gloo): real processes, two ranks.

Each rank calibrates on its share of the batches and the modifiers reduce what they gather; the
result must be the one process's, bit for bit where the statistics are sums of per-batch terms
(GPTQ's Hessians, ranges), written once by rank 0. Both ranks and the one process run with one
thread: matrix products split over threads differently round differently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import GPTQ_W4_G32, REPO, checkpoint_tensors, gloo_rank, make_tiny_llama, token_batches

import llmpress
from llmpress.data import CalibrationOptions
from llmpress.errors import DataError, SessionError
from llmpress.modifiers import GPTQModifier
from llmpress.modifiers.pruning.oneshot import owl_sparsities
from llmpress.parallel import distributed
from llmpress.pipelines.by_module import planner
from llmpress.pipelines.storage.compact import CompactWeights

GPTQ_W4 = GPTQ_W4_G32

#: asymmetric groups: a rank whose share of the stacked rows misses a module takes its zero
#: points (integers, not in its scales' dtype) from the rank that solved them
GPTQ_W4_ASYM = GPTQ_W4_G32.replace("symmetric: true", "symmetric: false")

#: SmoothQuant, then GPTQ with int8 weights and static per-tensor int8 inputs, and an fp8 KV cache:
#: every statistic kind (channel ranges, Hessians, input ranges, cache magnitudes) is reduced
SMOOTH_W8A8_STATIC = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.5
    GPTQModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}
          input_activations: {num_bits: 8, type: int, symmetric: true, strategy: tensor, dynamic: false}
      kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}
"""

#: SmoothQuant, then GPTQ W8A8 with dynamic inputs, calibrated in two passes: SmoothQuant's
#: ranges come from GPTQ's observing run and the Hessians are rescaled after their reduction
SMOOTH_W8A8_DYNAMIC = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
    GPTQModifier:
      ignore: [lm_head]
      scheme: W8A8
"""

#: one-shot pruning: SparseGPT's Hessians and Wanda's input norms are summed over the ranks, and
#: every rank prunes alike
SPARSEGPT_24 = """
sparsity_stage:
  sparsity_modifiers:
    SparseGPTModifier: {sparsity: 0.5, mask_structure: "2:4", ignore: ["re:.*lm_head"]}
"""
#: OWL's per-layer sparsities from the input norms of all the ranks' samples (one forward of the dense model)
SPARSEGPT_OWL = """
sparsity_stage:
  sparsity_modifiers:
    SparseGPTModifier: {sparsity: 0.5, sparsity_profile: owl, owl_m: 2, owl_lmbda: 0.08, ignore: ["re:.*lm_head"]}
"""
WANDA = """
sparsity_stage:
  sparsity_modifiers:
    WandaPruningModifier: {sparsity: 0.5, ignore: ["re:.*lm_head"]}
"""

AWQ_W4 = """
quant_stage:
  quant_modifiers:
    AWQModifier: {n_grid: 5}
    QuantizationModifier:
      ignore: [lm_head]
      scheme: W4A16
"""

#: rotations first: every rank rotates alike (no statistic), then GPTQ's Hessians are reduced
SPINQUANT_GPTQ = """
quant_stage:
  quant_modifiers:
    SpinQuantModifier: {rotations: [R1, R2]}
    GPTQModifier: {scheme: W4A16, targets: [Linear], ignore: [lm_head]}
"""

#: sensitivities measured on the first 3 of the 6 samples, on the ranks as in one process (each
#: rank's share of those 3, not its own first 3), each module's options weighed on one rank
MIXED_GPTQ = """
quant_stage:
  quant_modifiers:
    MixedPrecisionModifier: {average_bits: 4.5, samples: 3, schemes: [W3A16_G32, W4A16_G32, W8A16], ignore: [lm_head]}
    GPTQModifier: {}
"""

#: AutoRound with every sample in each step: the ranks' summed gradients have the one process's signs
AUTOROUND_W4 = """
quant_stage:
  quant_modifiers:
    AutoRoundModifier: {scheme: W4A16, ignore: [lm_head], iters: 6, batch_size: 8}
"""

OPTIONS = CalibrationOptions(num_samples=None, seq_len=32, batch_size=1)
TWO_PASSES = CalibrationOptions(num_samples=None, seq_len=32, batch_size=1, true_sequential=False)


def _samples() -> list[list[int]]:
    return token_batches(count=6, length=32)


def _run_rank(rank: int, world: int, init: str, model_dir: str, recipes: list[tuple[str, str]]) -> None:
    with gloo_rank(rank, world, init):
        for recipe, output in recipes:
            llmpress.oneshot(model_dir, recipe, _samples(), output_dir=output, calibration=_options(recipe))


def _one_process(model_dir: Path, recipe: str, output: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llmpress.oneshot(str(model_dir), recipe, _samples(), output_dir=output, calibration=_options(recipe))
    finally:
        torch.set_num_threads(threads)


def _options(recipe: str) -> CalibrationOptions:
    return TWO_PASSES if recipe == SMOOTH_W8A8_DYNAMIC else OPTIONS


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """The three recipes on two ranks (one spawn) and in one process."""
    work = tmp_path_factory.mktemp("ranks")
    make_tiny_llama(intermediate=256).save_pretrained(work / "model")
    recipes = {"gptq": GPTQ_W4, "gptq-asym": GPTQ_W4_ASYM, "smooth": SMOOTH_W8A8_STATIC, "smooth-dynamic": SMOOTH_W8A8_DYNAMIC, "awq": AWQ_W4,
               "sparsegpt": SPARSEGPT_24, "owl": SPARSEGPT_OWL, "wanda": WANDA, "spinquant": SPINQUANT_GPTQ,
               "mixed": MIXED_GPTQ, "autoround": AUTOROUND_W4}
    runs = [(recipe, str(work / f"{name}-2")) for name, recipe in recipes.items()]
    mp.spawn(_run_rank, args=(2, f"file://{work / 'rendezvous'}", str(work / "model"), runs), nprocs=2, join=True)
    for name, recipe in recipes.items():
        _one_process(work / "model", recipe, work / f"{name}-1")
    return work


@pytest.mark.parametrize("name", ["gptq", "gptq-asym", "smooth", "smooth-dynamic", "sparsegpt", "owl", "wanda", "spinquant", "mixed"])
def test_two_ranks_give_the_one_process_checkpoint(two_rank_runs, name):
    one = checkpoint_tensors(two_rank_runs / f"{name}-1")
    two = checkpoint_tensors(two_rank_runs / f"{name}-2")
    assert one.keys() == two.keys()
    different = [k for k in one if not torch.equal(one[k], two[k])]
    assert not different, different[:5]
    if name == "smooth":  # the reduced statistics are there: static input scales and cache scales
        assert any(k.endswith("input_scale") for k in one) and any(k.endswith("k_scale") for k in one)
    if name == "mixed":  # the ranks' sensitivities summed: the same choice, a mixed one, and the same measure
        configs = [json.loads((two_rank_runs / f"{name}-{n}" / "config.json").read_text()) for n in (1, 2)]
        groups = [c["quantization_config"]["config_groups"] for c in configs]
        assert groups[0] == groups[1] and len(groups[0]) >= 2
        measured = [torch.tensor([g["sensitivity"] for g in c["llmpress_mixed_precision"]["groups"]]) for c in configs]
        torch.testing.assert_close(measured[0], measured[1], rtol=1e-3, atol=0)
    if name in ("sparsegpt", "wanda"):  # pruned indeed
        assert (one["model.layers.1.mlp.up_proj.weight"] == 0).float().mean() == 0.5


def _owl_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()


def _owl_rank(rank: int, world: int, init: str, out: str) -> None:
    with gloo_rank(rank, world, init):
        model = _owl_model()
        batches = distributed.share_of([torch.tensor([s]) for s in token_batches(count=6, length=32)])
        modules = {n: m for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
        Path(out, f"{rank}.json").write_text(json.dumps(owl_sparsities(model, model.model.layers, modules, batches, 0.5, 2.0, 0.08)))


def test_owl_sparsities_on_two_ranks_are_the_one_process_ones(tmp_path):
    """OWL's outlier ratios come from the input norms of every rank's batches: with four layers
    (two would only ever get the two ends of the spread) each rank's own batches set other
    sparsities, and the ranks would prune alike to none of them."""
    mp.spawn(_owl_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, join=True)
    model = _owl_model()
    modules = {n: m for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    one = owl_sparsities(model, model.model.layers, modules, [torch.tensor([s]) for s in token_batches(count=6, length=32)], 0.5, 2.0, 0.08)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert len(set(one)) == 4  # four different sparsities
    assert ranks[0] == ranks[1]
    torch.testing.assert_close(torch.tensor(ranks[0]), torch.tensor(one), rtol=1e-6, atol=0)


def _mixed_rank(rank: int, world: int, init: str, out: str) -> None:
    from llmpress.modifiers.mixed_precision.measure import measure

    with gloo_rank(rank, world, init):
        model, modules, rows, options = _mixed_inputs()
        shapes = []

        def rounding(weight, hessian, scheme):
            shapes.append(list(weight.shape))
            return GPTQModifier(scheme="W4A16")._rounding(weight, hessian, scheme)

        costs = measure(model, modules, rows, options, rounding).costs
        Path(out, f"{rank}.json").write_text(json.dumps({"costs": costs, "shapes": shapes}))


def _mixed_inputs():
    from llmpress.modifiers.mixed_precision.menu import MixedPrecision

    model = _owl_model()
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    options = MixedPrecision(average_bits=4, schemes=["W3A16_G32", "W4A16_G32", "W8A16"]).options()
    return model, modules, [torch.tensor(s) for s in token_batches(count=4, length=32)], options


def test_two_ranks_weigh_each_module_by_halves_of_its_rows(tmp_path):
    """Each layer's Hessians go to both ranks and each weighs half of every module's rows (the
    options round row by row): the work of a layer splits evenly, not by whole Hessians (one
    down_proj outweighed the rest of its layer), and the sums are the one process's."""
    from llmpress.modifiers.mixed_precision.measure import measure

    mp.spawn(_mixed_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, join=True)
    model, modules, rows, options = _mixed_inputs()
    one = measure(model, modules, rows, options, GPTQModifier(scheme="W4A16")._rounding).costs
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["costs"] == ranks[1]["costs"]
    torch.testing.assert_close(torch.tensor([ranks[0]["costs"][n] for n in modules]), torch.tensor([one[n] for n in modules]),
                               rtol=1e-6, atol=0)
    every_row = sum(m.weight.shape[0] for m in modules.values()) * len(options)
    assert [sum(rows for rows, _ in share["shapes"]) for share in ranks] == [every_row // 2] * 2


def _near_the_budget_rank(rank: int, world: int, init: str, model_dir: str, output: str) -> None:
    with gloo_rank(rank, world, init):
        planner.KEPT_PER_BLOCK_WEIGHTS = NEAR_THE_BUDGET
        llmpress.oneshot(model_dir, GPTQ_W4, _samples(), output_dir=output, calibration=OPTIONS)


#: what the 6 samples' activations would keep per block is 0.5x its weights: over this budget in
#: one process, and each rank's 3 samples under it
NEAR_THE_BUDGET = 0.4


def test_the_ranks_choose_module_by_module_or_two_passes_as_one_process(two_rank_runs, tmp_path, monkeypatch):
    """The automatic choice weighs what one process would keep (summed over the ranks), not a
    rank's share: each rank went module by module where one process took two passes, and the
    checkpoints differed."""
    mp.spawn(_near_the_budget_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(two_rank_runs / "model"), str(tmp_path / "two")),
             nprocs=2, join=True)
    monkeypatch.setattr(planner, "KEPT_PER_BLOCK_WEIGHTS", NEAR_THE_BUDGET)
    _one_process(two_rank_runs / "model", GPTQ_W4, tmp_path / "one")
    one, two = checkpoint_tensors(tmp_path / "one"), checkpoint_tensors(tmp_path / "two")
    assert not [k for k in one if not torch.equal(one[k], two[k])]


def _rounded_sizes(rounded: list[int]):
    """``CompactWeights.integers`` that notes the size of each weight it rounds."""
    integers = CompactWeights.integers

    def noting(self, module):
        if isinstance(getattr(module, "weight", None), torch.nn.Parameter):
            rounded.append(module.weight.numel())
        return integers(self, module)

    return noting


def _rounding_rank(rank: int, world: int, init: str, model_dir: str, output: str) -> None:
    with gloo_rank(rank, world, init):
        rounded: list[int] = []
        CompactWeights.integers = _rounded_sizes(rounded)
        llmpress.oneshot(model_dir, GPTQ_W4, _samples(), output_dir=output, calibration=OPTIONS)
        Path(output).with_name(f"rounded-{rank}.json").write_text(json.dumps(rounded))


def test_the_ranks_share_the_rounding_of_each_finished_layer(two_rank_runs, tmp_path, monkeypatch):
    """A finished layer's weights are rounded to the integers rank 0 writes to the work folder
    once, each rank a share of them by size (rank 0 rounded them all while the others waited)."""
    mp.spawn(_rounding_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(two_rank_runs / "model"), str(tmp_path / "two")),
             nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rounded-{r}.json").read_text()) for r in (0, 1)]
    rounded: list[int] = []
    monkeypatch.setattr(CompactWeights, "integers", _rounded_sizes(rounded))
    _one_process(two_rank_runs / "model", GPTQ_W4, tmp_path / "one")
    assert sorted(ranks[0] + ranks[1]) == sorted(rounded) and ranks[0] and ranks[1]
    assert abs(sum(ranks[0]) - sum(ranks[1])) <= max(rounded)
    one, two = checkpoint_tensors(tmp_path / "one"), checkpoint_tensors(tmp_path / "two")
    assert not [k for k in one if not torch.equal(one[k], two[k])]


@pytest.mark.parametrize("name", ["awq", "autoround"])
def test_two_ranks_of_awq_and_autoround_choose_the_one_process_values(two_rank_runs, name):
    """AWQ's channel means, AutoRound's gradients: float sums in another order, equal to
    rounding; the grid search picks the same candidates, the signed steps go the same way."""
    one = checkpoint_tensors(two_rank_runs / f"{name}-1")
    two = checkpoint_tensors(two_rank_runs / f"{name}-2")
    if name == "autoround":  # the loss of the ranks' samples together: the one process's untuned loss, and after
        # tuning within a few percent (a gradient near zero may take the other sign in another summation order)
        records = [torch.tensor(json.loads((two_rank_runs / f"{name}-{n}" / "config.json").read_text())["llmpress_autoround"]["layers"])
                   for n in (1, 2)]
        assert records[0].shape == (2, 4) and torch.allclose(records[0][:, 1], records[1][:, 1], rtol=1e-4, atol=0)
        assert torch.allclose(records[0][:, 2], records[1][:, 2], rtol=0.05, atol=0)
        assert {k: v.shape for k, v in one.items()} == {k: v.shape for k, v in two.items()}
        return  # the values: a step that took another sign moves scales and packed words apart
    for key in one:
        if one[key].is_floating_point():
            torch.testing.assert_close(one[key], two[key], rtol=1e-3, atol=1e-5)
        else:
            assert (one[key] != two[key]).float().mean() < 0.01, key


def test_rank_zero_alone_writes_one_checkpoint(two_rank_runs):
    names = sorted(p.name for p in two_rank_runs.iterdir())
    assert names.count("gptq-2") == 1 and not [n for n in names if n.startswith(".") or "tmp" in n]
    loaded = llmpress.load(two_rank_runs / "gptq-2")
    assert loaded(input_ids=torch.tensor([[1, 2, 3]])).logits.isfinite().all()


@pytest.mark.parametrize("launch", ["torchrun", "forked"])
def test_the_command_runs_on_two_ranks(two_rank_runs, tmp_path, launch):
    """``torchrun --nproc-per-node 2 -m llmpress oneshot``, and ``llmpress oneshot --ranks 2``
    (the second rank forked from the first after its imports): every rank exits 0, one reports,
    the checkpoint is the one process's."""
    data = tmp_path / "samples.jsonl"
    data.write_text("\n".join('{"input_ids": %s}' % s for s in _samples()))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(GPTQ_W4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    runner = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if launch == "torchrun" else []
    command = [sys.executable, *runner, "-m", "llmpress",
               "oneshot", "--model", str(two_rank_runs / "model"), "--recipe", str(recipe), "--dataset", str(data),
               "--output", str(tmp_path / "out"), "--seq-len", "32", "--batch-size", "1", "--num-samples", "6",
               *(["--ranks", "2"] if launch == "forked" else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("saved ") == 1  # the main rank reports
    one = checkpoint_tensors(two_rank_runs / "gptq-1")
    two = checkpoint_tensors(tmp_path / "out")
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_share_of_needs_an_item_per_rank(monkeypatch):
    monkeypatch.setattr(distributed, "world_size", lambda: 4)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    assert distributed.share_of(list(range(10))) == [1, 5, 9]
    with pytest.raises(DataError, match="cannot be shared by 4 ranks"):
        distributed.share_of([1, 2, 3])


def test_owners_balance_the_work(monkeypatch):
    costs = [10.0, 9.0, 2.0, 1.0, 1.0]
    assert distributed.assign_owners(costs) == [0, 0, 0, 0, 0]  # one process: everything here
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    assert distributed.assign_owners(costs) == [0, 1, 1, 0, 0]  # largest first, to the least loaded


def test_a_modifier_that_does_not_reduce_is_refused_on_several_ranks(monkeypatch):
    from llmpress.modifiers import GPTQModifier

    monkeypatch.setattr(GPTQModifier, "reduces_across_ranks", False)
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    model = make_tiny_llama()
    session = llmpress.Session(GPTQModifier(scheme="W4A16", ignore=["lm_head"]))
    with session:
        session.initialize(model=model, calibration_data=[torch.tensor([[1, 2, 3]])])
        with pytest.raises(SessionError, match="cannot calibrate on several ranks"):
            session.calibration_start()


def test_ending_a_process_group_destroys_it_and_is_a_no_op_without_one(tmp_path):
    from llmpress.parallel.distributed import end_process_group

    end_process_group()  # none initialised: nothing to do
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    end_process_group()  # one rank: no barrier to wait at
    assert not torch.distributed.is_initialized()


def test_hessians_agreed_on_go_where_the_waiting_modules_are():
    """Under torch.distributed, a rank makes empty Hessians for modules only another rank's
    tokens reached (an MoE expert), on the device of a module still waiting for its solve, not on
    a finished layer's (its weight held as integers, the Parameter on ``meta``)."""
    from torch import nn

    from llmpress.modifiers import GPTQModifier

    modifier = GPTQModifier(scheme="W4A16")
    finished, waiting = nn.Linear(4, 4, device="meta"), nn.Linear(4, 4)
    modifier.modules = {"layers.0.q_proj": (finished, None), "layers.1.q_proj": (waiting, None)}
    modifier.pending = dict(modifier.modules)
    assert modifier._device == torch.device("cpu")
    modifier.pending = {"layers.0.q_proj": (finished, None)}
    assert modifier._device == torch.device("cpu")


def test_a_solve_is_split_by_rows_over_the_ranks(monkeypatch):
    """Every rank solves its share of the rows of modules sharing a Hessian (q, k, v stacked):
    the shares cover each module's rows once, in order; per-tensor qparams and Conv1D weights go
    whole to one rank instead."""
    from torch import nn

    from llmpress.modifiers.gptq import ranks

    q, k, v = nn.Linear(8, 10), nn.Linear(8, 4), nn.Linear(8, 4)
    share = ranks.RowShare([q, k, v], ["q", "k", "v"])
    monkeypatch.setattr(ranks, "world_size", lambda: 3)
    pieces = [share.pieces(r) for r in range(3)]
    assert pieces == [[(q, 0, 6)], [(q, 6, 10), (k, 0, 2)], [(k, 2, 4), (v, 0, 4)]]
    assert ranks.row_splittable("group", q) and ranks.row_splittable("channel", q)
    assert not ranks.row_splittable("tensor", q)
    monkeypatch.setattr(ranks, "world_size", lambda: 1)
    assert not ranks.row_splittable("group", q)  # one process: nothing to split
