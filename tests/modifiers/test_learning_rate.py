"""LearningRateModifier: the schedules."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_llama

import llmpress
from llmpress.errors import RecipeError
from llmpress.modifiers import (
    LearningRateModifier,
)
from llmpress.modifiers.learning_rate import scheduled_lr


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




