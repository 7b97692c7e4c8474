"""``OutputDistillationModifier``: the student learns the teacher's outputs as well as the labels.

At every ``loss_calculated`` the teacher runs on the inputs the student just saw (captured by a
hook on the student's forward, without labels, under ``no_grad``) and the loss becomes::

    orig_weight * loss + distill_weight * mean over targets of compare(student, teacher)

``targets`` are ``logits`` and/or module names (exact or ``re:``) whose outputs are compared,
e.g. the decoder layers' hidden states. ``comparison`` is ``kl`` (temperature-scaled
KL(teacher || student) per token, times T²) or ``mse``; tokens with ``attention_mask == 0`` do not
count::

    OutputDistillationModifier:
      targets: [logits]
      comparison: kl
      temperature: 2.0
      distill_weight: 1.0
      orig_weight: 0.5
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import field_validator
from torch import nn

from llmpress.contract.modifier import MODIFIERS, Modifier, State, WindowFields
from llmpress.errors import SessionError, UnsupportedModelError
from llmpress.targets import matches

__all__ = ["OutputDistillationModifier", "distillation_loss"]

LOGITS = "logits"


def distillation_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    comparison: str,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token ``kl`` or ``mse`` between outputs ``[..., features]``, averaged over the tokens
    ``mask`` keeps (all when None)."""
    teacher = teacher.to(student.dtype)
    if comparison == "kl":
        log_p_student = F.log_softmax(student.float() / temperature, dim=-1)
        log_p_teacher = F.log_softmax(teacher.float() / temperature, dim=-1)
        per_token = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(-1) * temperature**2
    else:
        per_token = (student.float() - teacher.float()).pow(2).mean(-1)
    if mask is not None and mask.shape == per_token.shape:
        mask = mask.to(per_token.dtype)
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    return per_token.mean()


class OutputDistillationConfig(WindowFields):
    targets: list[str] = [LOGITS]
    comparison: Literal["kl", "mse"] = "kl"
    temperature: float = 1.0
    distill_weight: float = 1.0
    orig_weight: float = 1.0

    @field_validator("targets", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("temperature")
    @classmethod
    def _positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"temperature must be positive, got {value}")
        return value


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise UnsupportedModelError("cannot find the output tensor to distill", got=type(output).__name__)


def _to_device(value: Any, device: torch.device) -> Any:
    """Tensors inside ``value`` (tuples, lists, dicts) moved to ``device``; the rest unchanged."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


class _Outputs:
    """Forward hooks that keep the latest output of each named module (``logits``: the model);
    ``with_grad_only`` skips forwards under ``no_grad`` (the student's evaluation)."""

    def __init__(self, model: nn.Module, names: list[str], with_grad_only: bool) -> None:
        self.values: dict[str, torch.Tensor] = {}
        self.with_grad_only = with_grad_only
        modules = dict(model.named_modules())
        self.handles = [modules[n].register_forward_hook(self._keeper(n)) for n in names]

    def _keeper(self, name: str):
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled() or not self.with_grad_only:
                self.values[name] = _first_tensor(output)

        return keep

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.values.clear()


@MODIFIERS.register("OutputDistillationModifier")
class OutputDistillationModifier(Modifier):
    Config = OutputDistillationConfig

    def required_state(self) -> tuple[str, ...]:
        return ("model", "teacher")

    def on_initialize(self, state: State) -> None:
        student, teacher = state.model, state.teacher
        if teacher is student:
            raise SessionError(
                f"{type(self).__name__}: the teacher is the student model itself",
                got="teacher=model",
                expected="a separate teacher model (it is frozen while the student trains)",
                fix="pass a copy: session.update_state(teacher=copy.deepcopy(model)) before any weight changes",
            )
        self.names = self._resolve(student, teacher)
        teacher.eval()
        teacher.requires_grad_(False)
        self.teacher = teacher
        self.inputs: tuple[tuple, dict] | None = None
        self.input_hook = student.register_forward_pre_hook(self._keep_inputs, with_kwargs=True)
        self.student_out = _Outputs(student, self.names, with_grad_only=True)
        self.teacher_out = _Outputs(teacher, self.names, with_grad_only=False)
        self.last_distill_loss: float | None = None

    def _resolve(self, student: nn.Module, teacher: nn.Module) -> list[str]:
        """Module names for the targets ('' for logits: the whole model's output)."""
        names: list[str] = []
        teacher_names = {n for n, _ in teacher.named_modules()}
        for target in self.config.targets:
            if target == LOGITS:
                names.append("")
                continue
            found = [n for n, m in student.named_modules() if n and matches(n, m, [target])]
            if not found:
                raise UnsupportedModelError(
                    f"{type(self).__name__}: target {target!r} matches no module of the student",
                    expected="'logits' or module names such as 'model.layers.3' or 're:model.layers.\\d+$'",
                )
            missing = [n for n in found if n not in teacher_names]
            if missing:
                raise UnsupportedModelError(
                    f"{type(self).__name__}: the teacher has no module {missing[0]!r}",
                    got=f"{len(missing)} student module(s) missing in the teacher",
                    expected="a teacher with the student's module names for hidden-state targets",
                    fix="distill logits only (targets: [logits]), or name modules both models have",
                )
            names += found
        return list(dict.fromkeys(names))

    def _keep_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():  # evaluation (no_grad) is not distilled: nothing held for it
            self.inputs = (args, kwargs)

    def on_loss_calculated(self, state: State, loss: torch.Tensor) -> torch.Tensor:
        if self.inputs is None or len(self.student_out.values) < len(self.names):
            raise SessionError(
                f"{type(self).__name__}: loss_calculated came without a forward pass of the student",
                expected="model(**batch) with gradients on, between batch_start and loss_calculated",
            )
        args, kwargs = self.inputs
        kwargs = {k: v for k, v in kwargs.items() if k not in ("labels", "num_items_in_batch")}
        device = loss.device
        teacher_device = next(self.teacher.parameters(), loss).device
        with torch.no_grad():
            self.teacher(*_to_device(args, teacher_device), **_to_device(kwargs, teacher_device))
        mask = kwargs.get("attention_mask")
        terms = [
            distillation_loss(
                self.student_out.values[n], self.teacher_out.values[n].to(device), self.config.comparison,
                self.config.temperature, mask,
            )
            for n in self.names
        ]
        distill = torch.stack(terms).mean()
        self.last_distill_loss = float(distill.detach())
        self._clear()
        return self.config.orig_weight * loss + self.config.distill_weight * distill

    def on_batch_end(self, state: State) -> None:
        self._clear()

    def _clear(self) -> None:
        self.inputs = None
        self.student_out.values.clear()
        self.teacher_out.values.clear()

    def on_finalize(self, state: State) -> None:
        self.input_hook.remove()
        self.student_out.remove()
        self.teacher_out.remove()
