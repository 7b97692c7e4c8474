"""Resumable one-shot runs: a run stopped after some layers, resumed, writes the checkpoint an
uninterrupted run writes, bit for bit; the work folder is checked before it is trusted."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from helpers import GPTQ_W4_G32, REPO, Stop, checkpoint_tensors, four_layers, oneshot_stopping_after, token_batches

import llmpress
from llmpress.data import CalibrationOptions
from llmpress.errors import CheckpointError, RecipeError
from llmpress.pipelines.storage.resume import WorkFolder

#: every kind of state a finished layer holds: smoothing folded into norms, int8 weights with
#: static input scales (hooks that must come back), an fp8 KV cache's scales
RECIPE = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier: {smoothing_strength: 0.5}
    GPTQModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 32}
          input_activations: {num_bits: 8, type: int, symmetric: true, strategy: tensor, dynamic: false}
      kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}
"""
OPTIONS = CalibrationOptions(num_samples=None, seq_len=32, batch_size=2)


def run(tmp_path, out, *, stop_after=None, resume=False, recipe=RECIPE, samples=None, monkeypatch=None, options=OPTIONS,
        overwrite=False):
    return oneshot_stopping_after(tmp_path, out, recipe=recipe, options=options, stop_after=stop_after, resume=resume,
                                  samples=samples, monkeypatch=monkeypatch, overwrite=overwrite)


@pytest.fixture
def model_dir(tmp_path):
    four_layers().save_pretrained(tmp_path / "model")
    return tmp_path


@pytest.mark.parametrize("inputs_after, two_passes", [(1, False), (0, False), (-1, False), (-1, True)])
def test_a_stopped_run_resumed_writes_the_uninterrupted_checkpoint(model_dir, monkeypatch, caplog, inputs_after, two_passes):
    """Stopped after its second layer, with the next inputs written after it (1), after the
    first layer only (0: the second is forwarded on them when resuming) or never (-1: both are
    forwarded from the first block's inputs); blocks calibrated module by module, or in two passes."""
    from dataclasses import replace

    from llmpress.pipelines.storage import resume

    options = replace(OPTIONS, true_sequential=False) if two_passes else OPTIONS
    whole = run(model_dir, model_dir / "whole", options=options)
    save = WorkFolder.save_layer

    def save_when_due(self, index, *args):
        monkeypatch.setattr(resume, "INPUTS_EVERY_S", 0.0 if index <= inputs_after else 1e9)
        save(self, index, *args)

    monkeypatch.setattr(WorkFolder, "save_layer", save_when_due)
    with pytest.raises(Stop):
        run(model_dir, model_dir / "cut", stop_after=1, monkeypatch=monkeypatch, options=options)
    assert not (model_dir / "cut").exists()
    progress = json.loads((model_dir / "cut.llmpress-work" / "progress.json").read_text())
    assert progress["layers"] == 2 and progress["inputs_after"] == inputs_after
    inputs_files = sorted(p.name for p in (model_dir / "cut.llmpress-work").glob("*.inputs.*"))
    assert inputs_files == ([f"layer-{inputs_after:05d}.inputs.rank0.pt"] if inputs_after >= 0 else [])
    with caplog.at_level(logging.INFO, logger="llmpress"):
        resumed = run(model_dir, model_dir / "cut", resume=True, options=options)
    assert "resumed after layer 1 of 4" in caplog.text
    assert ("forwarded layers" in caplog.text) == (inputs_after < 1)
    assert two_passes or "two passes" not in caplog.text  # the default here: module by module
    one, two = checkpoint_tensors(model_dir / "whole"), checkpoint_tensors(model_dir / "cut")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert any(k.endswith("k_scale") for k in one) and any(k.endswith("input_scale") for k in one)
    ids = torch.tensor([token_batches(count=1, seed=5)[0]])
    with torch.no_grad():  # the returned model computes what the uninterrupted one does (input hooks back on)
        assert torch.equal(resumed(input_ids=ids).logits, whole(input_ids=ids).logits)
    # finished: the work folder is gone, the checkpoint records the run
    assert not (model_dir / "cut.llmpress-work").exists() and (model_dir / "cut" / "llmpress_run.json").exists()


def test_a_run_stopped_after_its_last_layer_resumes_to_the_same_checkpoint_and_recipe(model_dir, monkeypatch):
    """Every layer restored, none calibrated: SmoothQuant's mappings, found while calibrating,
    still reach the saved recipe (kept in progress.json with each layer)."""
    run(model_dir, model_dir / "whole")
    with pytest.raises(Stop):
        run(model_dir, model_dir / "cut", stop_after=3, monkeypatch=monkeypatch)
    run(model_dir, model_dir / "cut", resume=True)
    one, two = checkpoint_tensors(model_dir / "whole"), checkpoint_tensors(model_dir / "cut")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    recipe = (model_dir / "whole" / "recipe.yaml").read_text()
    assert "mappings" in recipe and (model_dir / "cut" / "recipe.yaml").read_text() == recipe


def test_a_work_folder_written_before_inputs_were_spaced_out_resumes(model_dir, monkeypatch):
    """progress.json without ``inputs_after`` (inputs were written after every layer): its
    inputs are the last layer's; a later layer not due to write them keeps that right."""
    from llmpress.pipelines.storage import resume

    run(model_dir, model_dir / "whole")
    whole = checkpoint_tensors(model_dir / "whole")
    monkeypatch.setattr(resume, "INPUTS_EVERY_S", 0.0)
    with pytest.raises(Stop):
        run(model_dir, model_dir / "cut", stop_after=1, monkeypatch=monkeypatch)
    progress_file = model_dir / "cut.llmpress-work" / "progress.json"
    progress = json.loads(progress_file.read_text())
    del progress["inputs_after"], progress["notes"]
    progress_file.write_text(json.dumps(progress))
    monkeypatch.setattr(resume, "INPUTS_EVERY_S", 1e9)
    with pytest.raises(Stop):  # layer 2 finishes without writing inputs, then stops
        run(model_dir, model_dir / "cut", stop_after=2, resume=True, monkeypatch=monkeypatch)
    assert json.loads(progress_file.read_text())["inputs_after"] == 1
    run(model_dir, model_dir / "cut", resume=True)
    cut = checkpoint_tensors(model_dir / "cut")
    assert whole.keys() == cut.keys() and all(torch.equal(whole[k], cut[k]) for k in whole)


def test_resume_of_a_finished_run_does_nothing(model_dir, caplog):
    run(model_dir, model_dir / "out")
    stamp = os.stat(model_dir / "out")
    with caplog.at_level(logging.WARNING, logger="llmpress"):
        run(model_dir, model_dir / "out", resume=True)
    assert "already the finished checkpoint" in caplog.text
    assert os.stat(model_dir / "out").st_ino == stamp.st_ino
    with pytest.raises(CheckpointError, match="holds a checkpoint already"):  # without --resume: refused
        run(model_dir, model_dir / "out")
    run(model_dir, model_dir / "out", overwrite=True)  # or run again
    assert os.stat(model_dir / "out").st_ino != stamp.st_ino
    # another save into the folder replaces the record: the folder is no longer that run's
    llmpress.oneshot(str(model_dir / "model"), RECIPE + RECIPE.replace("quant_stage", "second_stage"), token_batches(count=6),
                     output_dir=model_dir / "out", calibration=OPTIONS, overwrite=True)
    assert "fingerprint" not in json.loads((model_dir / "out" / "llmpress_run.json").read_text())


def test_a_run_failing_in_its_first_layer_leaves_no_work_folder(model_dir, monkeypatch):
    """Nothing to go on from (a recipe refused on the model's first block, say): the folder goes;
    after a finished layer it stays for --resume."""
    def fail(self, index, *args):
        raise Stop

    with monkeypatch.context() as patched:
        patched.setattr(WorkFolder, "save_layer", fail)
        with pytest.raises(Stop):
            run(model_dir, model_dir / "out")
    assert not (model_dir / "out.llmpress-work").exists() and not (model_dir / "out").exists()
    with pytest.raises(Stop):
        run(model_dir, model_dir / "out", stop_after=0, monkeypatch=monkeypatch)
    assert json.loads((model_dir / "out.llmpress-work" / "progress.json").read_text())["layers"] == 1


def test_a_work_folder_of_another_run_is_refused(model_dir, monkeypatch):
    with pytest.raises(Stop):
        run(model_dir, model_dir / "out", stop_after=0, monkeypatch=monkeypatch)
    with pytest.raises(CheckpointError, match="of another run"):
        run(model_dir, model_dir / "out", resume=True, samples=token_batches(count=6, seed=1))
    other = RECIPE.replace("group_size: 32", "group_size: 16")
    with pytest.raises(CheckpointError, match="of another run"):
        run(model_dir, model_dir / "out", resume=True, recipe=other)


def test_a_damaged_work_folder_is_refused(model_dir, monkeypatch):
    with pytest.raises(Stop):
        run(model_dir, model_dir / "out", stop_after=1, monkeypatch=monkeypatch)
    state = model_dir / "out.llmpress-work" / "layer-00001.state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="damaged"):
        run(model_dir, model_dir / "out", resume=True)
    run(model_dir, model_dir / "out")  # without --resume: starts over
    assert (model_dir / "out" / "config.json").exists()


def test_a_recipe_of_several_stages_cannot_resume(model_dir):
    two_stages = RECIPE + RECIPE.replace("quant_stage", "second_stage")
    with pytest.raises(RecipeError, match="cannot resume"):
        run(model_dir, model_dir / "out", resume=True, recipe=two_stages)


def test_kill_9_in_the_third_layer_then_resume(model_dir, tmp_path):
    """The command, killed with SIGKILL while it calibrates its third layer (or its fourth, when
    this process was not scheduled in time to see the second finish), then ``--resume``."""
    data = tmp_path / "samples.jsonl"
    data.write_text("\n".join('{"input_ids": %s}' % s for s in token_batches(count=6)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}

    def command(out, *extra):
        return [sys.executable, "-m", "llmpress", "oneshot", "--model", str(model_dir / "model"), "--recipe", str(recipe),
                "--dataset", str(data), "--output", str(out), "--seq-len", "32", "--num-samples", "6", *extra]

    subprocess.run(command(tmp_path / "whole"), env=env, check=True, capture_output=True, timeout=300)
    progress = tmp_path / "cut.llmpress-work" / "progress.json"
    process = subprocess.Popen(command(tmp_path / "cut"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if progress.exists() and json.loads(progress.read_text())["layers"] >= 2:
            break
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert json.loads(progress.read_text())["layers"] in (2, 3), "the run was not killed before its last layer"
    done = subprocess.run(command(tmp_path / "cut", "--resume"), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    one, two = checkpoint_tensors(tmp_path / "whole"), checkpoint_tensors(tmp_path / "cut")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    again = subprocess.run(command(tmp_path / "cut", "--resume"), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "nothing to do" in again.stdout


def _mapping(tensor: torch.Tensor) -> tuple[str, int]:
    """The file whose mapping holds ``tensor``'s data ("" where none does: the heap), and where
    that mapping starts."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _, _, _, _, *path = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return (path[0].strip() if path else ""), low
    return "", 0


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings from /proc")
def test_finished_layers_wait_in_their_work_files_not_in_memory(model_dir, tmp_path, monkeypatch):
    """Each finished layer's held integers, scales and norms are swapped for the memory-mapped
    copies its work file holds, so they do not add up in RAM; the checkpoint is the one they
    would write from memory."""
    from llmpress.pipelines.storage import compact
    from llmpress.pipelines.storage.compact import CompactWeights

    swapped, mapped = [], []
    replace, put = CompactWeights.replace_integers, compact.put_tensor
    monkeypatch.setattr(CompactWeights, "replace_integers",
                        lambda self, module, k: swapped.append((module, _mapping(k))) or replace(self, module, k))
    monkeypatch.setattr(compact, "put_tensor", lambda module, name, value: mapped.append((name, value)) or put(module, name, value))
    llmpress.oneshot(model_dir / "model", RECIPE, token_batches(4, 32, vocab=512), output_dir=tmp_path / "paged", calibration=OPTIONS,
                     return_model=False)
    assert len(swapped) == 4 * 7  # four layers of seven linear modules
    names = Counter(name for name, _ in mapped)
    assert names["weight_scale"] == 4 * 7 and names["weight"] == 4 * 2  # and the two norms of each layer
    assert all(".state.pt" in _mapping(value)[0] for _, value in mapped)  # read from the file, not copied
    # the integers from a mapping of their own: the save unmaps it as it lets them go
    scales = {_mapping(value)[1] for name, value in mapped if name == "weight_scale"}
    assert all(".state.pt" in file and start not in scales for _, (file, start) in swapped)
    monkeypatch.setattr(CompactWeights, "page_out", lambda self, layer, state_file, adopt=False: None)
    llmpress.oneshot(model_dir / "model", RECIPE, token_batches(4, 32, vocab=512), output_dir=tmp_path / "held", calibration=OPTIONS,
                     return_model=False)
    assert checkpoint_tensors(tmp_path / "paged").keys() == checkpoint_tensors(tmp_path / "held").keys()
    assert (tmp_path / "paged" / "model.safetensors").read_bytes() == (tmp_path / "held" / "model.safetensors").read_bytes()


def test_kill_9_at_random_points_over_an_old_checkpoint(model_dir, tmp_path):
    """A run replacing an older checkpoint (--overwrite), killed with SIGKILL at seeded random
    points from start to finish: each time the output is the old checkpoint byte for byte or the
    new one complete, and --resume then writes the uninterrupted run's checkpoint bit for bit,
    leaving nothing of the killed saves beside it."""
    import random

    data = tmp_path / "samples.jsonl"
    data.write_text("\n".join('{"input_ids": %s}' % s for s in token_batches(count=6)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}

    def command(out, *extra, recipe=recipe):
        return [sys.executable, "-m", "llmpress", "oneshot", "--model", str(model_dir / "model"), "--recipe", str(recipe),
                "--dataset", str(data), "--output", str(out), "--seq-len", "32", "--num-samples", "6", *extra]

    def digests(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file()}

    start = time.monotonic()
    subprocess.run(command(tmp_path / "whole"), env=env, check=True, capture_output=True, timeout=300)
    whole = time.monotonic() - start
    reference = checkpoint_tensors(tmp_path / "whole")
    subprocess.run(command(tmp_path / "old", recipe="W8A16"), env=env, check=True, capture_output=True, timeout=300)
    old = digests(tmp_path / "old")
    for attempt, delay in enumerate(sorted(random.Random(7).uniform(0.2, 1.1) * whole for _ in range(3))):
        out = tmp_path / f"out{attempt}"
        shutil.copytree(tmp_path / "old", out)
        process = subprocess.Popen(command(out, "--overwrite"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            process.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
        if digests(out) != old:  # the new checkpoint, whole
            got = checkpoint_tensors(out)
            assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
        done = subprocess.run(command(out, "--resume"), env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        got = checkpoint_tensors(out)
        assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got), f"kill after {delay:.2f} s"
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")], "a killed save's folder was left"


ROTATED = {
    "quip": "QuIPModifier: {rotations: [v, u]}",
    "spinquant-r4": "SpinQuantModifier: {rotations: [R1, R2, R4], transform_type: random-hadamard}",
}


@pytest.mark.parametrize("rotation", list(ROTATED))
def test_a_stopped_run_with_run_time_rotations_resumes_to_the_uninterrupted_checkpoint(model_dir, monkeypatch, rotation):
    """Restored layers were saved with their weights rotated: only the run-time half of each
    rotation is attached again, so the resumed run quantizes, saves and computes what the
    uninterrupted one does."""
    recipe = (f"quant_stage:\n  quant_modifiers:\n    {ROTATED[rotation]}\n"
              "    GPTQModifier: {ignore: [lm_head], scheme: W4A16, targets: [Linear]}\n")
    whole = run(model_dir, model_dir / "whole", recipe=recipe)
    with pytest.raises(Stop):
        run(model_dir, model_dir / "cut", stop_after=1, recipe=recipe, monkeypatch=monkeypatch)
    resumed = run(model_dir, model_dir / "cut", resume=True, recipe=recipe)
    one, two = checkpoint_tensors(model_dir / "whole"), checkpoint_tensors(model_dir / "cut")
    assert any("_input." in k for k in one)  # run-time rotations stored
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    ids = torch.tensor([token_batches(count=1, seed=5)[0]])
    with torch.no_grad():
        assert torch.equal(resumed(input_ids=ids).logits, whole(input_ids=ids).logits)


@pytest.mark.parametrize("inputs_after", [5, 4])
def test_a_model_whose_layers_take_their_own_arguments_resumes_to_the_same_checkpoint(tmp_path, monkeypatch, inputs_after):
    """Gemma 3's sixth layer is a global one (its own rotary tables and mask): stopped after it,
    with the next inputs written after it (they carry its arguments) or after the layer before (it
    is forwarded when resuming), the resumed run gives the later sliding layers their own again."""
    from architectures import SMALL
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmpress.pipelines.storage import resume

    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma3_text", **{**SMALL, "head_dim": 32, "num_hidden_layers": 8})
    assert config.layer_types[5] == "full_attention" and config.layer_types[6] == "sliding_attention"
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "model")
    recipe, samples = GPTQ_W4_G32, token_batches(count=4, length=32, vocab=4096)
    run(tmp_path, tmp_path / "whole", recipe=recipe, samples=samples)
    save = WorkFolder.save_layer

    def save_when_due(self, index, *args):
        monkeypatch.setattr(resume, "INPUTS_EVERY_S", 0.0 if index == inputs_after else 1e9)
        save(self, index, *args)

    monkeypatch.setattr(WorkFolder, "save_layer", save_when_due)
    with pytest.raises(Stop):
        run(tmp_path, tmp_path / "cut", stop_after=5, recipe=recipe, samples=samples, monkeypatch=monkeypatch)
    run(tmp_path, tmp_path / "cut", resume=True, recipe=recipe, samples=samples)
    one, two = checkpoint_tensors(tmp_path / "whole"), checkpoint_tensors(tmp_path / "cut")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
