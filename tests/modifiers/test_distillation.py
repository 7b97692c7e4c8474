"""OutputDistillationModifier: the loss it adds, its teacher, and the events it needs."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_tiny_llama, train_steps, training_batch

import llmpress
from llmpress.errors import SessionError
from llmpress.modifiers import (
    OutputDistillationModifier,
)
from llmpress.modifiers.distillation import distillation_loss


def test_distillation_loss_values():
    logits = torch.randn(2, 5, 11)
    assert float(distillation_loss(logits, logits, "kl")) == pytest.approx(0.0, abs=1e-6)
    assert float(distillation_loss(logits, logits + 1.0, "mse")) == pytest.approx(1.0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    other = logits.clone()
    other[1] += 5.0
    assert float(distillation_loss(logits, other, "mse", mask=mask)) == pytest.approx(0.0)


def test_distillation_adds_the_teacher_term_for_logits_and_hidden_states():
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


def test_teacher_must_not_be_the_student():
    model = make_tiny_llama()
    with pytest.raises(SessionError, match="teacher is the student"):
        llmpress.Session(OutputDistillationModifier()).initialize(model=model, teacher=model)


