"""Training modifiers that change the forward or the loss: QAT, distillation, learning rate."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_tiny_llama, train_steps, training_batch

import llmpress
from llmpress.errors import MissingStateError, RecipeError, SessionError
from llmpress.modifiers import (
    LearningRateModifier,
    OutputDistillationModifier,
    QuantizationModifier,
)
from llmpress.modifiers.distillation import distillation_loss
from llmpress.modifiers.learning_rate import scheduled_lr
from llmpress.quant.qat import QAT_ATTR


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
        assert getattr(q_proj, QAT_ATTR) and q_proj.weight.grad.abs().sum() > 0  # straight-through
        step.optimizer_step(optimizer)
    losses = train_steps(session, model, optimizer, 20, same_batch=True)
    assert losses[-1] < losses[0]
    model.save_pretrained(tmp_path / "mid")  # mid-QAT: saved as finalize would round it now
    with torch.no_grad():
        mid_logits = model(input_ids=batch).logits
    session.finalize()
    assert not hasattr(q_proj, QAT_ATTR) and "forward" not in q_proj.__dict__
    scale = q_proj.weight_scale.repeat_interleave(128, dim=1)
    codes = q_proj.weight / scale
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=batch).logits, mid_logits, atol=1e-5)
        reloaded = llmpress.load_checkpoint(tmp_path / "mid")
        assert torch.allclose(reloaded(input_ids=batch).logits, mid_logits, atol=1e-4)


def test_qat_needs_calibrated_static_activation_scales():
    model = make_tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = llmpress.Session(QuantizationModifier(scheme="FP8", ignore=["lm_head"]))
    session.initialize(model=model, optimizer=optimizer, calibration_data=[training_batch()])
    with pytest.raises(SessionError, match="static input activations"):
        session.batch_start()


# -- distillation and learning rate -------------------------------------------------------------
def test_distillation_loss_values():
    logits = torch.randn(2, 5, 11)
    assert float(distillation_loss(logits, logits, "kl")) == pytest.approx(0.0, abs=1e-6)
    assert float(distillation_loss(logits, logits + 1.0, "mse")) == pytest.approx(1.0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    other = logits.clone()
    other[1] += 5.0
    assert float(distillation_loss(logits, other, "mse", mask=mask)) == pytest.approx(0.0)


def test_distillation_adds_the_teacher_term_and_hidden_statestrain_steps():
    student = make_tiny_llama()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    same = llmpress.Session(OutputDistillationModifier(distill_weight=2.0))
    same.initialize(model=student, teacher=copy.deepcopy(student), optimizer=optimizer)
    batch = training_batch()
    with same.training_step() as step:
        plain = student(input_ids=batch, labels=batch).loss
        assert float(step.loss(plain).detach()) == pytest.approx(float(plain.detach()), rel=1e-5)  # KL to itself: 0
    same.finalize()

    teacher = make_tiny_llama(seed=1)
    modifier = OutputDistillationModifier(targets=["re:model.layers.\\d+$"], comparison="mse", orig_weight=0.0)
    session = llmpress.Session(modifier).initialize(model=student, teacher=teacher, optimizer=optimizer)
    losses = train_steps(session, student, optimizer, 15, same_batch=True)
    assert losses[0] > 0 and losses[-1] < losses[0]
    session.finalize()
    assert not student._forward_pre_hooks and not teacher.model.layers[0]._forward_hooks


def test_distillation_names_a_module_the_teacher_lacks():
    from llmpress.errors import UnsupportedModelError

    small_teacher = make_tiny_llama()
    small_teacher.model.layers = small_teacher.model.layers[:1]
    session = llmpress.Session(OutputDistillationModifier(targets=["model.layers.1"]))
    with pytest.raises(UnsupportedModelError, match="teacher has no module 'model.layers.1'"):
        session.initialize(model=make_tiny_llama(), teacher=small_teacher)


def test_a_loss_changing_modifier_needs_loss_calculated():
    student = make_tiny_llama()
    session = llmpress.Session(OutputDistillationModifier())
    session.initialize(model=student, teacher=make_tiny_llama(seed=1))
    session.batch_start()
    with pytest.raises(SessionError, match="LlmpressTrainer"):
        session.batch_end()


def test_learning_rate_schedules():
    assert scheduled_lr("linear", 0.5, 1.0, 0.0) == pytest.approx(0.5)
    assert scheduled_lr("cosine", 0.5, 1.0, 0.0) == pytest.approx(0.5)
    assert scheduled_lr("cosine", 1.0, 1.0, 0.1) == pytest.approx(0.1)
    assert scheduled_lr("exponential", 0.5, 1.0, 0.01) == pytest.approx(0.1)
    with pytest.raises(RecipeError, match="needs final_lr and end"):
        LearningRateModifier(lr_func="linear", init_lr=0.1)
    model = make_tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    modifier = LearningRateModifier(lr_func="linear", init_lr=0.1, final_lr=0.0, end=1)
    session = llmpress.Session(modifier).initialize(model=model, optimizer=optimizer, steps_per_epoch=4)
    rates = []
    for _ in range(5):
        with session.training_step():
            session.optim_pre_step()
            rates.append(optimizer.param_groups[0]["lr"])
            session.optim_post_step()
    assert rates == pytest.approx([0.1, 0.075, 0.05, 0.025, 0.0])
    session.finalize()




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


def test_teacher_must_not_be_the_student():
    model = make_tiny_llama()
    with pytest.raises(SessionError, match="teacher is the student"):
        llmpress.Session(OutputDistillationModifier()).initialize(model=model, teacher=model)


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
    assert q_proj.quantization_scheme.input_activations is None and q_proj.weight_scale.shape == (128, 1)
