"""The session inside Hugging Face's ``Trainer``: a callback for the events, a thin subclass for
the loss.

``SessionCallback`` feeds a session from the Trainer's own objects: at ``on_train_begin`` it
records the model, the optimizer, the tokenizer and ``steps_per_epoch`` (optimizer steps, after
gradient accumulation) and initializes the session unless the caller already did; each optimizer
step then sends ``batch_start`` … ``batch_end``; ``on_train_end`` finalizes. A run resumed from
a checkpoint continues the schedules from the Trainer's step. A callback cannot
change the loss, so ``LlmpressTrainer`` adds ``loss_calculated`` in ``compute_loss``; with the
callback alone, a modifier that changes the loss (distillation) stops training with a clear
error at the end of the first step instead of silently doing nothing.

Every checkpoint the Trainer writes goes through ``save_pretrained``, which the session routes to
llmpress's one save path: compressed weights, ``sparsity_config`` and the recipe so far.
``LlmpressTrainer`` also reads such checkpoints back when resuming (``resume_from_checkpoint``,
``load_best_model_at_end``): a checkpoint saved mid-QAT resumes from its quantized weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from llmpress.errors import CheckpointError, MissingDependencyError, SessionError
from llmpress.lifecycle.attach import set_module_buffer
from llmpress.loading import load_checkpoint
from llmpress.session import Session, Status

__all__ = ["LlmpressTrainer", "SessionCallback", "load_compressed_into", "steps_per_epoch"]

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:  # pragma: no cover - transformers is a dependency
    raise MissingDependencyError("the Trainer integration needs transformers", fix="pip install transformers") from exc


def load_compressed_into(model: Any, folder: str) -> bool:
    """Load a compressed checkpoint (one the session saved mid-QAT) into ``model``: weights on
    their grid, and the grid itself (``weight_scale``), so QAT resumes where the file stands.
    Returns False for a plain checkpoint, which the Trainer loads itself."""
    config = Path(folder, "config.json")
    try:
        quantization = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    except ValueError as exc:
        raise CheckpointError("the checkpoint's config.json is not valid JSON", got=f"{config}: {exc}") from None
    if not quantization or quantization.get("quantization_status") != "compressed" or not quantization.get("config_groups"):
        return False

    weight = next(model.parameters())
    dense = load_checkpoint(folder, dtype=weight.dtype)
    qparams = ("weight_scale", "weight_zero_point", "weight_global_scale", "input_scale", "input_zero_point", "input_global_scale")
    state = {k: v for k, v in dense.state_dict().items() if not k.endswith(qparams)}
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(qparams)]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            "the compressed checkpoint does not match the model being trained",
            got=f"{len(missing)} missing, {len(result.unexpected_keys)} unexpected tensor(s), "
            f"e.g. {(missing or result.unexpected_keys)[0]!r}",
            expected="a checkpoint the same Trainer saved for this model",
        )
    live = dict(model.named_modules())
    for name, module in dense.named_modules():
        for buffer in ("weight_scale", "weight_zero_point", "weight_global_scale"):
            value = getattr(module, buffer, None)
            if name in live and isinstance(value, torch.Tensor):
                set_module_buffer(live[name], buffer, value.to(live[name].weight.device))
    return True


def steps_per_epoch(train_dataloader: Any, gradient_accumulation_steps: int) -> int | None:
    """Optimizer steps in one epoch, as the Trainer counts them."""
    try:
        batches = len(train_dataloader)
    except TypeError:  # an iterable dataset has no length: windows in epochs cannot be known
        return None
    return max(math.ceil(batches / max(gradient_accumulation_steps, 1)), 1)


class SessionCallback(TrainerCallback):
    """Sends a Trainer's steps to ``session``; initializes it at the start and finalizes it at the
    end of ``train()`` (``finalize=False`` leaves that to the caller)."""

    def __init__(self, session: Session, *, finalize: bool = True) -> None:
        self.session = session
        self.finalize = finalize

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        session = self.session
        if session.status != Status.CREATED:
            self._resume(state)
            return  # the caller initialized it with state of their own
        recorded = session.state
        steps = recorded.get("steps_per_epoch") or (
            steps_per_epoch(train_dataloader, args.gradient_accumulation_steps) if train_dataloader is not None else None
        )
        session.update_state(
            model=recorded.get("model") or model,
            optimizer=recorded.get("optimizer") or optimizer,
            steps_per_epoch=steps,
            processor=recorded.get("processor") or kwargs.get("processing_class"),
        )
        session.initialize()
        self._resume(state)

    def _resume(self, state) -> None:
        """``train(resume_from_checkpoint=...)``: the schedules continue from the Trainer's step."""
        if state.global_step and self.session.step == 0:
            self.session.resume_at(state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self.session.batch_start()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.session.optim_pre_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.session.optim_post_step()

    def on_step_end(self, args, state, control, **kwargs):
        self.session.batch_end()

    def on_train_end(self, args, state, control, **kwargs):
        if self.finalize and self.session.status == Status.INITIALIZED:
            self.session.finalize()


class LlmpressTrainer(Trainer):
    """``transformers.Trainer`` with a session: ``LlmpressTrainer(model=..., args=..., session=s)``
    or ``recipe=...`` (and ``teacher=...`` for distillation). The loss of every training batch
    goes through ``session.loss_calculated``."""

    def __init__(self, *args: Any, session: Session | None = None, recipe: Any = None, teacher: Any = None,
                 finalize: bool = True, **kwargs: Any) -> None:
        if (session is None) == (recipe is None):
            raise SessionError(
                "LlmpressTrainer needs exactly one of session= and recipe=",
                got="both" if session is not None else "neither",
                fix="pass recipe=... (a session is made for it) or session=llmpress.Session(recipe)",
            )
        self.session = session if session is not None else Session(recipe)
        if teacher is not None:
            self.session.update_state(teacher=teacher)
        callbacks = list(kwargs.pop("callbacks", None) or [])
        super().__init__(*args, callbacks=[*callbacks, SessionCallback(self.session, finalize=finalize)], **kwargs)
        if any("loss_calculated" in m.events for m in self.session.modifiers):
            # The model's loss then stays a per-batch mean (not pre-scaled over the accumulated
            # batches with num_items_in_batch), so a term a modifier adds (also a per-batch mean)
            # is scaled for gradient accumulation together with it by the Trainer.
            self.model_accepts_loss_kwargs = False

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not load_compressed_into(model if model is not None else self.model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model=model)

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        if best is None or not load_compressed_into(self.model, best):
            super()._load_best_model()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training and self.session.status == Status.INITIALIZED:
            loss = self.session.loss_calculated(loss)
        return (loss, outputs) if return_outputs else loss
