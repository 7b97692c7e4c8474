"""Quantization-aware training: the fake-quantized forward, its grid, freezing, and stages around it."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_tiny_llama, train_steps, training_batch

import llmpress
from llmpress.errors import MissingStateError, RecipeError, SessionError
from llmpress.lifecycle.qat import QATLinear, in_qat
from llmpress.lifecycle.state import Status, scheme_of, status_of
from llmpress.modifiers import (
    QuantizationModifier,
)


# -- QAT ----------------------------------------------------------------------------------------
def test_qat_starts_at_the_rtn_model_trains_and_freezes_on_the_grid(tmp_path):
    model = make_tiny_llama(intermediate=256)
    llmpress.oneshot(model, "W4A16")
    batch = training_batch()
    with torch.no_grad():
        rtn_loss = float(model(input_ids=batch, labels=batch).loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = llmpress.Session(QuantizationModifier(scheme="W4A16", ignore=["lm_head"]))
    session.initialize(model=model, optimizer=optimizer)
    model.train()
    with session.training_step() as step:
        loss = step.loss(model(input_ids=batch, labels=batch).loss)
        assert float(loss.detach()) == pytest.approx(rtn_loss, rel=1e-6)  # the same grid: the same model
        loss.backward()
        q_proj = model.model.layers[0].self_attn.q_proj
        assert in_qat(q_proj) and type(q_proj) is QATLinear and q_proj.weight.grad.abs().sum() > 0  # straight-through
        step.optimizer_step(optimizer)
    losses = train_steps(session, model, optimizer, 20, same_batch=True)
    assert losses[-1] < losses[0]
    model.save_pretrained(tmp_path / "mid")  # mid-QAT: saved as finalize would round it now
    with torch.no_grad():
        mid_logits = model(input_ids=batch).logits
    session.finalize()
    assert not in_qat(q_proj) and type(q_proj) is torch.nn.Linear and status_of(q_proj) == Status.FROZEN
    scale = q_proj.weight_scale.repeat_interleave(128, dim=1)
    codes = q_proj.weight / scale
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=batch).logits, mid_logits, atol=1e-5)
        reloaded = llmpress.load_checkpoint(tmp_path / "mid")
        assert torch.allclose(reloaded(input_ids=batch).logits, mid_logits, atol=1e-4)


def test_qat_after_gptq_starts_on_gptqs_grid():
    """GPTQ fills in its observer and column order (``observer: mse``, ``actorder: static``);
    neither moves the grid, so a training stage's W4A16 keeps GPTQ's scales and its first step
    computes what the GPTQ model computes (it re-observed them, off GPTQ's rounding)."""
    from llmpress.modifiers import GPTQModifier

    model = make_tiny_llama(intermediate=256)
    llmpress.oneshot(model, [GPTQModifier(scheme="W4A16", ignore=["lm_head"])], [training_batch(i)[0].tolist() for i in range(4)])
    q_proj = model.model.layers[0].self_attn.q_proj
    assert scheme_of(q_proj).weights.observer == "mse"
    scale = q_proj.weight_scale.clone()
    batch = training_batch()
    with torch.no_grad():
        gptq_loss = float(model(input_ids=batch, labels=batch).loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = llmpress.Session(QuantizationModifier(scheme="W4A16", ignore=["lm_head"]))
    session.initialize(model=model, optimizer=optimizer)
    assert torch.equal(q_proj.weight_scale, scale)
    model.train()
    with session.training_step() as step:
        loss = step.loss(model(input_ids=batch, labels=batch).loss)
        assert float(loss.detach()) == pytest.approx(gptq_loss, rel=1e-6)
        loss.backward()
        step.optimizer_step(optimizer)
    session.finalize()
    assert torch.equal(q_proj.weight_scale, scale)


def test_qat_needs_calibrated_static_activation_scales():
    model = make_tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = llmpress.Session(QuantizationModifier(scheme="FP8", ignore=["lm_head"]))
    session.initialize(model=model, optimizer=optimizer, calibration_data=[training_batch()])
    with pytest.raises(SessionError, match="static input activations"):
        session.batch_start()


def test_saving_before_qat_starts_gives_the_rtn_snapshot(tmp_path):
    model = make_tiny_llama(intermediate=256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = llmpress.Session(QuantizationModifier(scheme="W4A16", ignore=["lm_head"], start=1))
    session.initialize(model=model, optimizer=optimizer, steps_per_epoch=4)
    train_steps(session, model, optimizer, 1)  # epoch 0: plain training, QAT starts at epoch 1
    model.save_pretrained(tmp_path / "early")  # what finalize would give now: RTN of these weights
    batch = training_batch()
    with torch.no_grad():
        expected = copy.deepcopy(model)
    rtn = llmpress.oneshot(expected, "W4A16")
    with torch.no_grad():
        saved = llmpress.load_checkpoint(tmp_path / "early")(input_ids=batch).logits
        assert torch.allclose(saved, rtn(input_ids=batch).logits, atol=1e-4)
    session.finalize()


def test_qat_with_another_scheme_drops_the_earlier_grid_and_frozen_weights_stop_training():
    model = make_tiny_llama(intermediate=256)
    llmpress.oneshot(model, "W8A16")  # per-channel int8 grid
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    qat = QuantizationModifier(scheme="W4A16", ignore=["lm_head"], end=0.5)
    session = llmpress.Session(qat).initialize(model=model, optimizer=optimizer, steps_per_epoch=4)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert getattr(q_proj, "weight_scale", None) is None  # the int8 scales do not fit int4 groups
    train_steps(session, model, optimizer, 2)  # the window closes: weights frozen on the int4 grid
    frozen = q_proj.weight.detach().clone()
    assert not q_proj.weight.requires_grad
    train_steps(session, model, optimizer, 2)
    assert torch.equal(q_proj.weight, frozen)
    session.finalize()


def test_gptq_refuses_a_training_window_and_one_shot_windows_say_why_they_need_epochs():
    from llmpress.modifiers import GPTQModifier

    with pytest.raises(RecipeError, match="one-shot"):
        GPTQModifier(scheme="W4A16", start=1)
    with pytest.raises(MissingStateError, match="start/end window"):
        llmpress.Session(QuantizationModifier(scheme="W4A16", start=1)).initialize(model=make_tiny_llama())


def test_a_stage_with_another_scheme_drops_the_old_input_quantization():
    model = make_tiny_llama(intermediate=256)
    llmpress.oneshot(model, "FP8", [training_batch(0)[0].tolist()])  # static input scales, input hooks
    q_proj = model.model.layers[0].self_attn.q_proj
    assert getattr(q_proj, "input_scale", None) is not None
    session = llmpress.Session(QuantizationModifier(scheme="W4A16", ignore=["lm_head"]))
    session.initialize(model=model)
    assert getattr(q_proj, "input_scale", None) is None and getattr(q_proj, "weight_scale", None) is None
    session.finalize()
    assert scheme_of(q_proj).input_activations is None and q_proj.weight_scale.shape == (128, 1)


def test_each_module_carries_one_state_through_its_lifecycle():
    """One ``ModuleState`` per module (no other llmpress attribute), its status moving PENDING ->
    TRAINING -> FROZEN; QAT is a swap of the module's class, so a model in QAT copies and
    pickles like any other and the copy computes the same."""
    import copy
    import pickle

    model = make_tiny_llama(intermediate=256)
    session = llmpress.Session(QuantizationModifier(scheme="W4A16", ignore=["lm_head"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session.initialize(model=model, optimizer=optimizer)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert status_of(q_proj) == Status.PENDING and status_of(model.lm_head) is None
    batch = training_batch()
    with session.training_step() as step:
        step.loss(model(input_ids=batch, labels=batch).loss).backward()
        step.optimizer_step(optimizer)
        optimizer.zero_grad()
    assert status_of(q_proj) == Status.TRAINING and isinstance(q_proj, QATLinear)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=batch).logits
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert type(twin.model.layers[0].self_attn.q_proj) is QATLinear
            torch.testing.assert_close(twin(input_ids=batch).logits, expected)
    session.finalize()
    assert status_of(q_proj) == Status.FROZEN and type(q_proj) is torch.nn.Linear
    ours = {k for m in model.modules() if m is not model for k in vars(m) if "llmpress" in k}
    assert ours == {"llmpress_state"}, ours
    assert {k for k in vars(model) if "llmpress" in k} == {"llmpress_record"}  # the model's own: its recipe
