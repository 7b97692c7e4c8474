"""Code from a model folder runs only when the user asks (``trust_remote_code``,
``--trust-remote-code``), never because of what standard input says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO, make_tiny_llama

import llmpress
from llmpress.errors import CheckpointError
from llmpress.loading.remote_code import remote_code_files

#: a model that brings its own code, which leaves a mark when it runs
REMOTE_CODE = '''
import os
import pathlib

pathlib.Path(os.environ["LLMPRESS_REMOTE_MARK"]).write_text("ran")

from transformers import LlamaConfig, LlamaForCausalLM


class MarkedConfig(LlamaConfig):
    model_type = "marked_llama"


class MarkedForCausalLM(LlamaForCausalLM):
    config_class = MarkedConfig
'''


@pytest.fixture
def remote_model(tmp_path, monkeypatch):
    folder = tmp_path / "remote"
    model = make_tiny_llama()
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="marked_llama", architectures=["MarkedForCausalLM"],
                  auto_map={"AutoConfig": "marked.MarkedConfig", "AutoModelForCausalLM": "marked.MarkedForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "marked.py").write_text(REMOTE_CODE)
    mark = tmp_path / "mark"
    monkeypatch.setenv("LLMPRESS_REMOTE_MARK", str(mark))
    return folder, mark, model


def test_a_folder_with_its_own_code_is_refused_naming_the_files(remote_model, tmp_path):
    folder, mark, _ = remote_model
    assert remote_code_files(folder) == ["marked.py"]
    for attempt in (lambda: llmpress.load(folder), lambda: llmpress.read_checkpoint(folder),
                    lambda: llmpress.oneshot(str(folder), "W8A16", None, output_dir=tmp_path / "out")):
        with pytest.raises(CheckpointError, match=r"marked\.py.*trust-remote-code"):
            attempt()
    assert not mark.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--json"], ["generate", "--prompt", "x"]])
def test_the_command_never_runs_it_whatever_standard_input_says(remote_model, command):
    """``echo y | llmpress inspect FOLDER`` ran the folder's code; now it is a clear error."""
    folder, mark, _ = remote_model
    if command[0] == "inspect":
        argv = [*command, str(folder)]
    else:
        argv = [command[0], "--model", str(folder), *command[1:]]
    done = subprocess.run([sys.executable, "-m", "llmpress", *argv], input="y\ny\n", capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode != 0 and "--trust-remote-code" in done.stderr, done.stderr[-2000:]
    assert done.stdout == "" and not mark.exists()


def test_trusted_code_runs_and_the_model_loads(remote_model):
    folder, mark, model = remote_model
    loaded = llmpress.load(folder, trust_remote_code=True, compile_decode=False)
    assert mark.read_text() == "ran" and type(loaded).__name__ == "MarkedForCausalLM"
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
