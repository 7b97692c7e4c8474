"""``llmpress eval --tasks``: lm-evaluation-harness on the model ``llmpress.load`` gives, with a
local task of our own (a multiple-choice continuation task over the fixture's evaluation text:
the true next words against words from elsewhere), gives the accuracy ``lm_eval`` gives run
directly on the dequantized model, beside perplexity in one table.

It runs where ``llmpress[eval]`` is installed. The dev environment leaves lm-eval out: it brings
scipy (through scikit-learn), which transformers then imports with every model class (its
object-detection losses), 40 MB more in every process, benchmarks included. ``make test`` runs
this file again in ``.venv-eval``: lm-eval over ``.venv``'s packages, at their versions."""

from __future__ import annotations

import json
import random

import pytest
from helpers import text_path, trained_model_dir

import llmpress
from llmpress import cli

lm_eval = pytest.importorskip("lm_eval")

TASK = """task: llmpress_next_words
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("task")
    words = text_path("evaluation.txt").read_text(encoding="utf-8").split()
    rng = random.Random(0)
    docs = []
    for i in range(24):
        start = 400 + 150 * i
        prompt, truth = " ".join(words[start : start + 40]), " " + " ".join(words[start + 40 : start + 46])
        others = [" " + " ".join(words[s : s + 6]) for s in rng.sample(range(5000, len(words) - 10), 3)]
        answer = rng.randrange(4)
        choices = others[:answer] + [truth] + others[answer:]
        docs.append({"prompt": prompt, "choices": choices, "answer": answer})
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    (folder / "llmpress_next_words.yaml").write_text(TASK.format(data=data), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    out = tmp_path_factory.mktemp("w8") / "w8a16"
    llmpress.oneshot(str(trained_model_dir()), "W8A16", output_dir=out)
    return out


def test_eval_tasks_match_lm_eval_on_the_dequantized_model(task_folder, compressed, capsys):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from llmpress.loading.loader import read_tokenizer

    assert cli.main(["eval", "--model", str(compressed), "--dataset", str(text_path("evaluation.txt")), "--max-windows", "4",
                     "--tasks", "llmpress_next_words", "--include-path", str(task_folder), "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ours = row["tasks"]["llmpress_next_words"]["acc"]
    assert row["perplexity"] > 1 and 0.35 < ours <= 1  # the trained model knows its text: well above chance (0.25)
    dense = llmpress.load(compressed, dequantize=True)
    direct = lm_eval.simple_evaluate(model=HFLM(pretrained=dense, tokenizer=read_tokenizer(compressed), batch_size=8),
                                     tasks=["llmpress_next_words"], task_manager=TaskManager(include_path=str(task_folder)),
                                     log_samples=False, bootstrap_iters=0)
    assert direct["results"]["llmpress_next_words"]["acc,none"] == ours


def test_table_and_plot_hold_tasks(task_folder, compressed, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert cli.main(["eval", "--model", str(compressed), "--model", str(trained_model_dir()), "--tasks", "llmpress_next_words",
                     "--include-path", str(task_folder), "--limit", "8", "--plot", str(tmp_path / "scores.png")]) == 0
    table = capsys.readouterr().out
    assert "llmpress_next_words acc" in table and "perplexity" not in table
    assert (tmp_path / "scores.png").stat().st_size > 1000


def test_unknown_task_is_a_clear_error(compressed, capsys):
    assert cli.main(["eval", "--model", str(compressed), "--tasks", "no_such_task_anywhere"]) != 0
    assert "lm-eval does not know these tasks" in capsys.readouterr().err
