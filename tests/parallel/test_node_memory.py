"""Ranks on one machine sharing memory (``parallel/node.py``): two spawned gloo ranks sum their
Hessians into one shared copy, factor it together, and meet with their solved rows there; each
result must be the bits of the same work done by one process, or through gloo's collectives."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import gloo_rank

from llmpress.lifecycle.attach import attach_scheme
from llmpress.modifiers.gptq.algorithm import factor_hessian
from llmpress.modifiers.gptq.ranks import RowShare
from llmpress.modifiers.hessians import HessianAccumulator
from llmpress.parallel import node as node_memory
from llmpress.parallel.node import close_node_team, node_team
from llmpress.quant.presets import preset_scheme

#: (columns, dead columns, activation order, positive definite): several block columns and a
#: halving two deep in the factor; a Hessian that needs more dampening (retried together)
FACTORS = [(600, 0, False, True), (600, 3, True, True), (300, 0, True, False)]


def _hessian(columns: int, dead: int, definite: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(columns + dead)
    x = torch.randn(2 * columns if definite else columns // 3, columns, generator=generator)
    x[:, :dead] = 0
    hessian = x.t() @ x / x.shape[0]
    if not definite:
        hessian -= 0.5 * torch.eye(columns)  # indefinite until dampened enough
    return hessian


def _on_ranks(rank: int, world: int, init: str, out: str) -> None:
    with gloo_rank(rank, world, init):
        team = node_team()
        found: dict[str, object] = {"team": team is not None, "folder": str(team.folder) if team else ""}
        for columns, dead, actorder, definite in FACTORS:
            hessian = _hessian(columns, dead, definite)
            alone = factor_hessian(hessian.clone(), 0.01, actorder, overwrite=True)
            shared = team.tensors([((columns, columns), torch.float32)])[0]
            if rank == 0:
                shared.copy_(hessian)
            team.sync()
            together = factor_hessian(shared, 0.01, actorder, overwrite=True, team=team)
            found[f"factor {columns} {dead} {actorder}"] = (
                torch.equal(alone.inverse, together.inverse), alone.dampening, together.dampening,
                alone.perm is None or torch.equal(alone.perm, together.perm))
        for columns in (200, 600):  # one block; row blocks of the upper triangle
            x = torch.randn(3, 16, columns, generator=torch.Generator().manual_seed(10 * columns + rank))
            through_gloo, on_node = HessianAccumulator(columns, torch.device("cpu")), HessianAccumulator(columns, torch.device("cpu"))
            through_gloo.add(x)
            on_node.add(x)
            through_gloo.reduce()
            on_node.reduce(node=team)
            found[f"hessian {columns}"] = (torch.equal(through_gloo.result(), on_node.result()), on_node.node is team,
                                           through_gloo.samples == on_node.samples)
        found["rows"] = _rows_met(team)
        node_memory._free_bytes = lambda: 0  # a full /dev/shm: gloo carries the sums instead
        x = torch.randn(2, 8, 600, generator=torch.Generator().manual_seed(rank))
        through_gloo, on_node = HessianAccumulator(600, torch.device("cpu")), HessianAccumulator(600, torch.device("cpu"))
        through_gloo.add(x)
        on_node.add(x)
        through_gloo.reduce()
        on_node.reduce(node=team)
        found["full"] = (torch.equal(through_gloo.result(), on_node.result()), on_node.node is None)
        close_node_team()
        os.environ["LLMPRESS_NODE_MEMORY"] = "0"
        found["off"] = node_team() is None
        torch.save(found, Path(out) / f"rank-{rank}.pt")


def _rows_met(team) -> bool:
    """A stacked solve's rows (two modules, int4 groups of 8), shared out and gathered through
    gloo and through shared memory: the same weights, scales, zero points and summed losses."""
    results = []
    for node in (None, team):
        modules = [torch.nn.Linear(8, rows, bias=False) for rows in (5, 6)]
        for module in modules:
            scheme = preset_scheme("W4A16_ASYM", targets=["Linear"])
            attach_scheme(module, scheme.model_copy(update={"weights": scheme.weights.model_copy(update={"group_size": 8})}))
        share = RowShare(modules, ["a", "b"])
        for module, a, b in share.pieces():
            rows = b - a
            weight = torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8) + 100 * a + team.rank
            share.take(module, a, b, weight, torch.full((rows, 1), float(a + 1)), torch.full((rows, 1), a, dtype=torch.int8),
                       0.25 * (team.rank + 1))
        losses: dict[str, float] = {}
        share.gather(losses, node)
        results.append([(m.weight.data.clone(), m.weight_scale.clone(), m.weight_zero_point.clone(), losses[n])
                        for m, n in zip(modules, ["a", "b"], strict=True)])
    return all(torch.equal(x, y) for one, other in zip(*results, strict=True) for x, y in zip(one[:3], other[:3], strict=True)) \
        and [r[3] for r in results[0]] == [r[3] for r in results[1]]


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory):
    work = tmp_path_factory.mktemp("node")
    mp.spawn(_on_ranks, args=(2, f"file://{work / 'rendezvous'}", str(work)), nprocs=2, join=True)
    return [torch.load(work / f"rank-{r}.pt", weights_only=False) for r in range(2)]


def test_the_ranks_of_one_machine_share_a_folder_that_is_gone_after(on_two_ranks):
    assert all(found["team"] for found in on_two_ranks)
    assert on_two_ranks[0]["folder"] == on_two_ranks[1]["folder"]
    assert not os.path.exists(on_two_ranks[0]["folder"])  # removed as the group ended


@pytest.mark.parametrize("case", FACTORS, ids=lambda c: f"{c[0]}-dead{c[1]}-actorder{c[2]}-definite{c[3]}")
def test_a_factor_computed_together_is_the_one_computed_alone(on_two_ranks, case):
    columns, dead, actorder, definite = case
    for found in on_two_ranks:
        same, dampening_alone, dampening_together, same_order = found[f"factor {columns} {dead} {actorder}"]
        assert same and same_order
        assert dampening_alone == dampening_together
        assert (dampening_alone > 0.01) == (not definite)  # the indefinite one was retried


@pytest.mark.parametrize("columns", [200, 600])
def test_a_hessian_summed_in_shared_memory_is_the_one_summed_by_gloo(on_two_ranks, columns):
    for found in on_two_ranks:
        assert found[f"hessian {columns}"] == (True, True, True)


def test_a_full_shared_memory_leaves_the_sums_to_gloo(on_two_ranks):
    assert all(found["full"] == (True, True) for found in on_two_ranks)


def test_solved_rows_meet_in_shared_memory_as_through_gloo(on_two_ranks):
    assert all(found["rows"] for found in on_two_ranks)


def test_no_team_in_one_process_or_when_turned_off(on_two_ranks):
    assert node_team() is None
    assert all(found["off"] for found in on_two_ranks)  # LLMPRESS_NODE_MEMORY=0: the collectives carry it all


def _one_rank_ends(rank: int, world: int, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    team = node_team()
    if rank == 1:
        os._exit(0)  # gone without a word, as a killed rank is
    try:
        team.sync()
        message = "no error"
    except Exception as exc:  # noqa: BLE001 - what it was is the answer
        message = f"{type(exc).__name__}: {exc}"
    shutil.rmtree(team.folder, ignore_errors=True)
    Path(out, "rank-0.txt").write_text(message)
    os._exit(0)  # no group teardown: its peer is gone


def test_a_rank_that_ends_is_named_by_the_ranks_waiting_for_it(tmp_path):
    mp.spawn(_one_rank_ends, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "rank-0.txt").read_text().startswith("SessionError: rank 1 ended while the other ranks waited for it")
