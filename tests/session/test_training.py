"""Compression inside training loops: events, windows, the five training modifiers, QAT."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_llama, sparsity_record, train_steps

import llmpress
from llmpress.errors import MissingStateError, RecipeError, SessionError
from llmpress.modifiers import (
    ConstantPruningModifier,
    LearningRateModifier,
    MagnitudePruningModifier,
    OutputDistillationModifier,
    QuantizationModifier,
)
from llmpress.modifiers.pruning import cubic_sparsity
from llmpress.modifiers.pruning.masks import magnitude_mask


def _proj_sparsity(model) -> list[float]:
    return [float((m.weight == 0).float().mean()) for n, m in model.named_modules() if n.endswith("_proj")]


# -- events ------------------------------------------------------------------------------------
def _initialized(recipe=None) -> llmpress.Session:
    model = make_tiny_llama()
    session = llmpress.Session(recipe or ConstantPruningModifier())
    return session.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=4)


@pytest.mark.parametrize(
    "events",
    [
        ["loss_calculated"],  # before batch_start
        ["optim_pre_step"],
        ["batch_end"],
        ["batch_start", "batch_start"],
        ["batch_start", "optim_post_step"],  # no optim_pre_step
        ["batch_start", "optim_pre_step", "batch_end"],  # no optim_post_step
        ["batch_start", "optim_pre_step", "optim_post_step", "optim_pre_step"],  # two steps in one batch
        ["batch_start", "calibration_start"],
        ["calibration_start", "batch_start"],
        ["layer_calibrated"],
    ],
)
def test_out_of_order_events_are_session_errors(events):
    session = _initialized()
    *fine, wrong = events
    for name in fine:
        session.event(name, **({"loss": torch.tensor(1.0)} if name == "loss_calculated" else {}))
    with pytest.raises(SessionError, match="out of order"):
        payload = {"loss": torch.tensor(1.0)} if wrong == "loss_calculated" else {}
        payload = {"index": 0, "layer": None} if wrong == "layer_calibrated" else payload
        session.event(wrong, **payload)


def test_finalize_inside_a_batch_is_an_error():
    session = _initialized()
    session.batch_start()
    with pytest.raises(SessionError, match="inside a batch"):
        session.finalize()
    session.batch_end()
    session.finalize()


def test_steps_count_optimizer_steps_and_give_epochs():
    session = _initialized()
    for _ in range(3):  # gradient accumulation: batches without a step do not count
        session.batch_start()
        session.loss_calculated(torch.tensor(1.0))
        session.batch_end()
    assert session.step == 0
    for _ in range(6):
        session.batch_start()
        session.optim_pre_step()
        session.optim_post_step()
        session.batch_end()
    assert session.step == 6 and session.epoch == pytest.approx(1.5)


def test_a_failed_batch_leaves_the_session_usable():
    session = _initialized()
    with pytest.raises(RuntimeError):
        with session.training_step():
            raise RuntimeError("loss was nan")
    with session.training_step():
        pass
    session.finalize()


def test_modifiers_act_only_inside_their_window():
    model = make_tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lr = LearningRateModifier(lr_func="linear", init_lr=0.5, final_lr=0.3, start=1.0, end=2.0)
    session = llmpress.Session(lr).initialize(model=model, optimizer=optimizer, steps_per_epoch=2)
    seen = []
    for _ in range(7):
        with session.training_step():
            session.optim_pre_step()
            seen.append(optimizer.param_groups[0]["lr"])  # the rate this step uses
            session.optim_post_step()
        optimizer.param_groups[0]["lr"] = 0.9  # the loop's own scheduler, say
    assert seen[:2] == [0.1, 0.9]  # epoch 0: untouched
    assert seen[2:4] == pytest.approx([0.5, 0.4])  # epoch 1: the schedule
    assert seen[4:] == pytest.approx([0.3] * 3)  # after the window: the final rate stays
    session.finalize()


def test_window_fields_validate_and_accept_minus_one():
    assert MagnitudePruningModifier(final_sparsity=0.5, end=1).config.end == 1
    assert ConstantPruningModifier(end=-1).config.end is None
    with pytest.raises(RecipeError):
        ConstantPruningModifier(start=2, end=1)
    with pytest.raises(RecipeError, match="mask_structure"):
        MagnitudePruningModifier(final_sparsity=0.5, end=1, mask_structure="4:2")
    with pytest.raises(RecipeError, match="at most 0.50"):
        MagnitudePruningModifier(final_sparsity=0.6, end=1, mask_structure="2:4")


# -- every modifier names its missing state and works with state from several places ------------
def _five_modifiers():
    return [
        (ConstantPruningModifier(), ["model"]),
        (MagnitudePruningModifier(final_sparsity=0.5, end=1), ["model", "steps_per_epoch"]),
        (QuantizationModifier(scheme="W4A16", ignore=["lm_head"]), ["model"]),
        (OutputDistillationModifier(), ["model", "teacher"]),
        (LearningRateModifier(lr_func="linear", init_lr=0.1, final_lr=0.01, end=1), ["optimizer", "steps_per_epoch"]),
    ]


@pytest.mark.parametrize("index", range(5))
def test_each_modifier_names_the_missing_state(index):
    modifier, needs = _five_modifiers()[index]
    model = make_tiny_llama()
    full = {
        "model": model,
        "teacher": make_tiny_llama(seed=1),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "steps_per_epoch": 4,
    }
    for missing in needs:
        session = llmpress.Session(modifier)
        session.update_state(**{k: v for k, v in full.items() if k != missing})
        with pytest.raises(MissingStateError, match=f"{type(modifier).__name__} needs '{missing}'"):
            session.initialize()
    session = llmpress.Session(modifier)
    for key, value in full.items():  # one field per call, from different places
        session.update_state(**{key: value})
    session.initialize()
    train_steps(session, model, full["optimizer"], 2)
    session.finalize()


# -- pruning ------------------------------------------------------------------------------------
def test_cubic_schedule_and_magnitude_masks():
    assert cubic_sparsity(0.0, 0.1, 0.5) == pytest.approx(0.1)
    assert cubic_sparsity(1.0, 0.1, 0.5) == pytest.approx(0.5)
    assert cubic_sparsity(0.5, 0.0, 0.8) == pytest.approx(0.8 * (1 - 0.125))
    weight = torch.randn(8, 16)
    keep = magnitude_mask(weight, 0.25, None)
    assert int((~keep).sum()) == 32
    assert weight.abs()[~keep].max() <= weight.abs()[keep].min()
    two_four = magnitude_mask(weight, 0.5, (2, 4))
    assert bool((two_four.reshape(-1, 4).sum(1) == 2).all())
    partial = magnitude_mask(weight, 0.25, (2, 4))  # below 2:4's own sparsity: still within its pattern
    assert int((~partial).sum()) == 32 and bool((partial | ~two_four).all())


@pytest.mark.parametrize("structure", ["unstructured", "2:4"])
def test_magnitude_pruning_schedule_reaches_final_sparsity(structure):
    model = make_tiny_llama(intermediate=256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pruning = MagnitudePruningModifier(
        targets=["re:.*_proj$"], init_sparsity=0.1, final_sparsity=0.5, end=1, mask_structure=structure
    )
    session = llmpress.Session(pruning).initialize(model=model, optimizer=optimizer, steps_per_epoch=4)
    seen = []
    for i in range(6):
        train_steps(session, model, optimizer, 1)
        seen.append(sum(_proj_sparsity(model)) / len(_proj_sparsity(model)))
    assert seen[0] == pytest.approx(cubic_sparsity(0.25, 0.1, 0.5), abs=0.01)
    assert seen == sorted(seen) and seen[3] == pytest.approx(0.5, abs=0.005)
    assert all(s == pytest.approx(0.5, abs=0.005) for s in _proj_sparsity(model))  # kept after the window
    session.finalize()
    if structure == "2:4":
        for name, module in model.named_modules():
            if name.endswith("_proj"):
                assert bool(((module.weight != 0).reshape(-1, 4).sum(1) <= 2).all())


def test_constant_pruning_keeps_zeros_through_optimizer_steps():
    model = make_tiny_llama()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("_proj"):
                module.weight.mul_(magnitude_mask(module.weight, 0.4, None))
    zeros = {n: m.weight == 0 for n, m in model.named_modules() if n.endswith("_proj")}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = llmpress.Session(ConstantPruningModifier()).initialize(model=model, optimizer=optimizer)
    train_steps(session, model, optimizer, 3)
    session.finalize()
    for name, module in model.named_modules():
        if name in zeros:
            assert bool((module.weight[zeros[name]] == 0).all())
            assert bool((module.weight[~zeros[name]] != 0).all())


def test_pruning_checkpoint_keeps_zeros_and_says_so(tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_tiny_llama(intermediate=256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = llmpress.Session(MagnitudePruningModifier(final_sparsity=0.5, end=1, mask_structure="2:4"))
    session.initialize(model=model, optimizer=optimizer, steps_per_epoch=2)
    train_steps(session, model, optimizer, 1)
    model.save_pretrained(tmp_path / "mid")  # mid-schedule, through the one save path
    train_steps(session, model, optimizer, 1)
    session.finalize()
    model.save_pretrained(tmp_path / "final")

    for folder, sparsity, structure in (("mid", cubic_sparsity(0.5, 0.0, 0.5), "unstructured"), ("final", 0.5, "2:4")):
        config = sparsity_record(tmp_path / folder)
        assert config["global_sparsity"] == pytest.approx(sparsity, abs=0.01)
        assert config["sparsity_structure"] == structure  # mid-schedule the zeros are not 2:4 yet
        assert "MagnitudePruningModifier" in (tmp_path / folder / "recipe.yaml").read_text()
    assert "lm_head" in config["ignore"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    ours = llmpress.load(tmp_path / "final")
    for reloaded in (loaded, ours):
        assert float((reloaded.model.layers[0].mlp.down_proj.weight == 0).float().mean()) == pytest.approx(0.5)
    from llmpress.loading.inspect import describe_checkpoint

    assert describe_checkpoint(tmp_path / "final")["sparsity"].startswith("2:4, 50.0% zeros")
    ours.save_pretrained(tmp_path / "again")  # loaded pruned: saving keeps the record
    assert sparsity_record(tmp_path / "again")["sparsity_structure"] == "2:4"


def test_resume_at_replays_closed_windows_and_continues_open_ones():
    model = make_tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    early = LearningRateModifier(lr_func="linear", init_lr=0.1, final_lr=0.01, end=1)
    pruning = MagnitudePruningModifier(final_sparsity=0.5, end=4)
    session = llmpress.Session([early, pruning]).initialize(model=model, optimizer=optimizer, steps_per_epoch=2)
    session.resume_at(4)  # epoch 2: the learning-rate window has closed, pruning is half way
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    train_steps(session, model, optimizer, 1)
    assert session.step == 5
    assert session.modifiers[1].sparsity == pytest.approx(cubic_sparsity(2.5 / 4, 0.0, 0.5))
    with pytest.raises(SessionError, match="after training events"):
        session.resume_at(2)
    session.finalize()


def test_n_m_sparsity_is_recorded_with_its_own_n_and_m(tmp_path):

    model = make_tiny_llama(intermediate=256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    pruning = MagnitudePruningModifier(targets=["re:.*_proj$"], final_sparsity=0.5, end=1, mask_structure="4:8")
    session = llmpress.Session(pruning).initialize(model=model, optimizer=optimizer, steps_per_epoch=1)
    train_steps(session, model, optimizer, 1)
    session.finalize()
    model.save_pretrained(tmp_path / "out")
    config = sparsity_record(tmp_path / "out")
    assert config["sparsity_structure"] == "4:8"
