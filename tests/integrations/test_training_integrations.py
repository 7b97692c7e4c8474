"""The session in Hugging Face's Trainer and in staged recipes; the pruning examples as they are."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO, make_tiny_llama, sparsity_record, text_path, trained_model_dir

import llmpress
from llmpress.errors import RecipeError, SessionError
from llmpress.modifiers import MagnitudePruningModifier, OutputDistillationModifier


def _trainer_args(tmp_path, **overrides):
    from transformers import TrainingArguments

    settings = dict(
        output_dir=str(tmp_path / "run"), num_train_epochs=2, per_device_train_batch_size=4,
        learning_rate=1e-3, save_strategy="epoch", report_to=[], use_cpu=True, disable_tqdm=True,
    )
    return TrainingArguments(**{**settings, **overrides})


def _token_dataset(count: int = 16):
    ids = torch.randint(0, 512, (count, 16), generator=torch.Generator().manual_seed(0)).tolist()
    return [{"input_ids": row, "labels": row} for row in ids]


def test_trainer_prunes_on_schedule_and_every_checkpoint_is_sparse(tmp_path):
    from llmpress.integrations.trainer import LlmpressTrainer

    model = make_tiny_llama(intermediate=256)
    pruning = MagnitudePruningModifier(targets=["re:.*_proj$"], final_sparsity=0.5, end=1.5)
    trainer = LlmpressTrainer(
        model=model, args=_trainer_args(tmp_path, gradient_accumulation_steps=2), train_dataset=_token_dataset(),
        recipe=pruning,
    )
    trainer.train()
    session = trainer.session
    assert session.status.value == "finalized" and session.state.steps_per_epoch == 2 and session.step == 4
    trainer.save_model(str(tmp_path / "run"))
    run = tmp_path / "run"
    for checkpoint, expected in (("checkpoint-2", 0.5 * (1 - (1 / 3) ** 3)), ("checkpoint-4", 0.5), (".", 0.5)):
        assert sparsity_record(run / checkpoint)["global_sparsity"] == pytest.approx(expected, abs=0.005)
        assert "MagnitudePruningModifier" in (run / checkpoint / "recipe.yaml").read_text()
    assert (run / "checkpoint-2" / "optimizer.pt").exists()  # the final save kept the Trainer's checkpoints


def test_trainer_distills_through_compute_loss_and_a_bare_callback_refuses(tmp_path):
    from transformers import Trainer

    from llmpress.integrations.trainer import LlmpressTrainer, SessionCallback

    teacher = make_tiny_llama(seed=1)
    trainer = LlmpressTrainer(
        model=make_tiny_llama(), args=_trainer_args(tmp_path, num_train_epochs=1, gradient_accumulation_steps=2),
        train_dataset=_token_dataset(8), recipe=OutputDistillationModifier(comparison="kl"), teacher=teacher,
    )
    # the model's loss stays a per-batch mean, so the Trainer scales both terms for accumulation
    assert trainer.model_accepts_loss_kwargs is False
    trainer.train()
    assert trainer.session.step == 1
    distill = trainer.session.modifiers[0].last_distill_loss
    assert distill is not None and distill > 0

    session = llmpress.Session(OutputDistillationModifier()).update_state(teacher=teacher)
    bare = Trainer(
        model=make_tiny_llama(), args=_trainer_args(tmp_path / "bare", num_train_epochs=1),
        train_dataset=_token_dataset(8), callbacks=[SessionCallback(session)],
    )
    with pytest.raises(SessionError, match="LlmpressTrainer"):
        bare.train()


def test_saving_into_a_folder_keeps_what_else_is_there(tmp_path):
    model = make_tiny_llama()
    out = tmp_path / "out"
    (out / "checkpoint-7").mkdir(parents=True)
    (out / "checkpoint-7" / "optimizer.pt").write_bytes(b"state")
    (out / "README.md").write_text("notes")
    (out / "run.sh").write_text("#!/bin/sh\n")
    (out / "run.sh").chmod(0o755)
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    llmpress.save_checkpoint(out, model)
    assert (out / "checkpoint-7" / "optimizer.pt").read_bytes() == b"state"
    assert (out / "README.md").read_text() == "notes"
    assert (out / "run.sh").stat().st_mode & 0o777 == 0o755  # kept files keep their modes
    assert not (out / "model-00001-of-00002.safetensors").exists()  # stale weights do not survive
    assert (out / "model.safetensors").exists()


def test_oneshot_refuses_training_stages_and_run_type_is_checked():
    recipe = {"prune_stage": {"MagnitudePruningModifier": {"final_sparsity": 0.5, "end": 1}}}
    with pytest.raises(RecipeError, match="llmpress.train"):
        llmpress.oneshot(make_tiny_llama(), recipe)
    from llmpress.entrypoints import is_training_stage
    from llmpress.recipe import Recipe

    qat = Recipe.from_any({"qat_stage": {"QuantizationModifier": {"scheme": "W4A16", "end": 1}}}).stages[0]
    rtn = Recipe.from_any({"rtn_stage": {"QuantizationModifier": {"scheme": "W4A16"}}}).stages[0]
    assert is_training_stage(qat) and not is_training_stage(rtn)
    with pytest.raises(RecipeError, match="run_type"):
        llmpress.oneshot(make_tiny_llama(), {"a_stage": {"run_type": "later", "QuantizationModifier": {"scheme": "W8A8"}}})


STAGED = """
quant_stage:
  quant_modifiers:
    QuantizationModifier: {scheme: W4A16, ignore: [lm_head]}
recovery_stage:
  run_type: train
  recovery_modifiers:
    QuantizationModifier: {scheme: W4A16, ignore: [lm_head]}
    OutputDistillationModifier: {targets: [logits], comparison: kl, orig_weight: 0.0}
"""


@pytest.mark.integration
@pytest.mark.slow
def test_staged_recipe_rtn_then_qat_with_distillation_beats_rtn(tmp_path):
    """One YAML: RTN W4A16, then QAT recovery distilled from the original model. The stage
    checkpoint is saved, and QAT's perplexity is below RTN's on the shared model."""
    from llmpress.evaluation import evaluation_windows, perplexity
    from llmpress.loading.loader import read_model_and_processor

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(STAGED)
    options = llmpress.TrainingOptions(lr=1e-4, max_steps=40, batch_size=8, seq_len=128, epochs=10)
    llmpress.train(trained_model_dir(), recipe, text_path("calibration.txt"), output_dir=tmp_path / "out", training=options)
    _, tokenizer = read_model_and_processor(trained_model_dir())
    windows = evaluation_windows(text_path("evaluation.txt").read_text(), tokenizer, 256, 20)
    rtn = perplexity(llmpress.load_checkpoint(tmp_path / "out" / "quant_stage"), windows, progress=False).perplexity
    qat = perplexity(llmpress.load_checkpoint(tmp_path / "out"), windows, progress=False).perplexity
    assert qat < rtn
    assert "recovery_stage" in (tmp_path / "out" / "recipe.yaml").read_text()
    assert "recovery_stage" not in (tmp_path / "out" / "quant_stage" / "recipe.yaml").read_text()
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"


def _run_example(script: str, output) -> str:
    command = [
        sys.executable, str(REPO / "examples" / script), "--model", str(trained_model_dir()),
        "--text", str(text_path("calibration.txt")), "--output", str(output),
        "--max-samples", "128", "--max-windows", "10",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _pruned_fraction(folder) -> dict[str, float]:
    from llmpress.lifecycle.sparsity import sparsity_of

    model = llmpress.load_checkpoint(folder)
    config = sparsity_record(folder)
    modules = dict(model.named_modules())
    return {name: sparsity_of(modules[name]) for name in config["targets"]}


def _perplexities(stdout: str) -> tuple[float, float]:
    rows = {line.split("  ")[0]: line.split() for line in stdout.splitlines() if line.startswith(("dense", "pruned"))}
    return float(rows["dense (before)"][2]), float(rows["pruned (checkpoint)"][2])


@pytest.mark.integration
@pytest.mark.slow
def test_pruning_examples_trainer_and_plain_loop_agree(tmp_path):
    results = {}
    for script in ("prune_with_trainer.py", "prune_with_torch_loop.py"):
        stdout = _run_example(script, tmp_path / script)
        sparsity = _pruned_fraction(tmp_path / script)
        assert len(sparsity) == 28 and all(abs(s - 0.5) <= 0.01 for s in sparsity.values())
        before, after = _perplexities(stdout)
        results[script] = (sparsity, after)
        assert after < before * 1.5  # recovered, not broken
    (trainer_sparsity, trainer_ppl), (loop_sparsity, loop_ppl) = results.values()
    assert trainer_sparsity == pytest.approx(loop_sparsity, abs=1e-3)
    assert abs(trainer_ppl - loop_ppl) / loop_ppl < 0.05


@pytest.mark.integration
@pytest.mark.slow
def test_cli_train_runs_a_staged_recipe_and_the_sparsity_survives_reloading(tmp_path):
    from llmpress.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "prune_stage:\n  MagnitudePruningModifier: {final_sparsity: 0.5, end: 1, mask_structure: '2:4'}\n"
        "quant_stage:\n  QuantizationModifier: {scheme: W8A8, ignore: [lm_head]}\n"
    )
    out = tmp_path / "out"
    code = main([
        "train", "--model", str(trained_model_dir()), "--recipe", str(recipe), "--dataset", str(text_path("calibration.txt")),
        "--output", str(out), "--num-samples", "32", "--seq-len", "64", "--batch-size", "4",
    ])
    assert code == 0 and (out / "prune_stage" / "model.safetensors").exists()
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    record = sparsity_record(out)
    assert config["format"] == "int-quantized" and record["sparsity_structure"] == "2:4"
    resaved = tmp_path / "resaved"
    llmpress.load(out).save_pretrained(resaved)  # runtime int8 modules: the sparsity is still described
    again = sparsity_record(resaved)
    assert again["targets"] == record["targets"]
    assert again["global_sparsity"] == pytest.approx(0.5, abs=0.01)


def test_trainer_resumed_from_a_checkpoint_continues_the_schedule(tmp_path):
    from llmpress.integrations.trainer import LlmpressTrainer

    def run(resume=None):
        pruning = MagnitudePruningModifier(targets=["re:.*_proj$"], final_sparsity=0.5, end=1.5)
        trainer = LlmpressTrainer(
            model=make_tiny_llama(intermediate=256), args=_trainer_args(tmp_path, num_train_epochs=2),
            train_dataset=_token_dataset(), recipe=pruning,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    first = run()
    assert first.session.step == 8
    resumed = run(str(tmp_path / "run" / "checkpoint-4"))  # epoch 1 of 2
    assert resumed.session.step == 8 and resumed.session.modifiers[0].sparsity == 0.5
    # the schedule went on from step 4 (the window closed at step 6): finalize had nothing to force
    assert resumed.session.modifiers[0].window.state == "closed"
    assert resumed.session.modifiers[0].last_update == pytest.approx(1.5)


def test_trainer_qat_checkpoints_are_quantized_and_match_the_finalized_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from llmpress.integrations.trainer import LlmpressTrainer
    from llmpress.modifiers import QuantizationModifier

    trainer = LlmpressTrainer(
        model=make_tiny_llama(intermediate=256), args=_trainer_args(tmp_path, num_train_epochs=1),
        train_dataset=_token_dataset(), recipe=QuantizationModifier(scheme="W4A16", ignore=["lm_head"]),
    )
    trainer.train()  # the checkpoint of the last step is written mid-QAT, then train() finalizes
    checkpoint = tmp_path / "run" / "checkpoint-4"
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["quantization_status"] == "compressed"
    batch = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        final = trainer.model.eval()(input_ids=batch).logits
        saved = AutoModelForCausalLM.from_pretrained(checkpoint)(input_ids=batch).logits
    assert torch.allclose(saved, final, atol=1e-4)


def test_trainer_resumes_qat_from_a_compressed_checkpoint(tmp_path):
    from llmpress.integrations.trainer import LlmpressTrainer, load_compressed_into
    from llmpress.modifiers import QuantizationModifier

    def trainer(epochs):
        return LlmpressTrainer(
            model=make_tiny_llama(intermediate=256), args=_trainer_args(tmp_path, num_train_epochs=epochs),
            train_dataset=_token_dataset(), recipe=QuantizationModifier(scheme="W4A16", ignore=["lm_head"]),
        )

    trainer(1).train()
    checkpoint = tmp_path / "run" / "checkpoint-4"
    fresh = make_tiny_llama(intermediate=256)
    assert load_compressed_into(fresh, str(checkpoint))
    batch = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        saved = llmpress.load_checkpoint(checkpoint)(input_ids=batch).logits
        assert torch.allclose(fresh(input_ids=batch).logits, saved, atol=1e-4)  # weights on grid, loaded
    assert fresh.model.layers[0].self_attn.q_proj.weight_scale.shape == (128, 1)  # and the grid itself
    resumed = trainer(2)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.session.step == 8
