"""lm-evaluation-harness tasks on the model ``llmpress.load`` gives (its CPU kernels), as
llm-compressor's users report accuracy: ``llmpress eval --tasks arc_easy,hellaswag``. A task is
one of lm-eval's, or a YAML task of the user's own in ``--include-path`` (a local dataset: no
network needed)."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from llmpress.errors import DataError, MissingDependencyError

__all__ = ["task_scores"]

logger = logging.getLogger(__name__)


def task_scores(model: nn.Module, tokenizer: Any, tasks: list[str], *, include_path: str | None = None, limit: int | None = None,
                batch_size: int = 8, num_fewshot: int | None = None) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` (``acc``, ``acc_norm``, ``exact_match``...; no standard errors)
    of ``model`` on lm-eval ``tasks`` (at most ``limit`` documents each)."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise MissingDependencyError("--tasks runs lm-evaluation-harness, which is not installed",
                                     fix="pip install 'lm-eval>=0.4.13'  (or pip install 'llmpress[eval]')") from None
    if tokenizer is None:
        raise DataError("lm-eval tasks need the checkpoint's tokenizer", got="no tokenizer", fix="save the tokenizer beside the model")
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise DataError("lm-eval does not know these tasks", got=unknown, expected="task names of lm-eval, or YAML tasks in --include-path",
                        fix="lm-eval --tasks list shows them; a task of your own: its YAML in a folder given as --include-path")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                  log_samples=False, bootstrap_iters=0, verbosity="WARNING")
    scores: dict[str, dict[str, float]] = {}
    for task, metrics in out["results"].items():
        scores[task] = {name.split(",")[0]: float(value) for name, value in metrics.items()
                        if isinstance(value, (int, float)) and "_stderr" not in name and name != "samples"}
    return scores
