"""Scripts written as llm-compressor's examples are (``tests/llmcompressor_examples``: GPTQ W4A16
on ultrachat's chat messages, FP8 dynamic, AWQ W4A16 on pile-val text) run with llmpress, their
``llmcompressor`` import lines changed and nothing else but ``MODEL_ID``, which points at the
trained tiny Llama. Their datasets come from a Hugging Face cache made here (offline), in the
layout ``datasets.load_dataset`` reads when the Hub cannot be reached."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, trained_model_dir

import llmpress

datasets = pytest.importorskip("datasets")

EXAMPLES = REPO / "tests" / "llmcompressor_examples"
IMPORTS = {
    "from llmcompressor import oneshot": "from llmpress import oneshot",
    "from llmcompressor.modifiers.quantization import GPTQModifier": "from llmpress.modifiers import GPTQModifier",
    "from llmcompressor.modifiers.quantization import QuantizationModifier": "from llmpress.modifiers import QuantizationModifier",
    "from llmcompressor.modifiers.awq import AWQModifier": "from llmpress.modifiers import AWQModifier",
    "from llmcompressor.utils import dispatch_for_generation": "from llmpress import dispatch_for_generation",
}
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"


def cache_hub_dataset(hf_home: Path, repo_id: str, splits: dict[str, dict[str, list]]) -> None:
    """``repo_id``'s splits in ``datasets``' own cache under ``hf_home``, as a first
    ``load_dataset`` with the network leaves them (read back offline)."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {}
    for split, columns in splits.items():
        files[split] = [str(hf_home / f"{split}.parquet")]
        datasets.Dataset.from_dict(columns).to_parquet(files[split][0])
    builder = Parquet(cache_dir=str(hf_home / "datasets"), dataset_name=repo_id.split("/")[-1], config_name="default",
                      data_files=files, hash="0" * 16)
    builder.download_and_prepare()
    target = hf_home / "datasets" / repo_id.replace("/", "___") / "default" / "0.0.0" / Path(builder.cache_dir).name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(builder.cache_dir, target)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """A Hugging Face cache with the two datasets, and the tiny Llama with a chat template."""
    root = tmp_path_factory.mktemp("examples")
    words = (REPO.parent / "shared" / "fixtures" / "text" / "calibration.txt")
    text = words.read_text(encoding="utf-8").split() if words.exists() else ["def", "print", "return"] * 400
    chunks = [" ".join(text[i * 60 : (i + 1) * 60]) for i in range(24)]
    cache_hub_dataset(root / "hf", "HuggingFaceH4/ultrachat_200k", {"train_sft": {
        "prompt": chunks[:12], "messages": [[{"role": "user", "content": c[:80]}, {"role": "assistant", "content": c}] for c in chunks[:12]]}})
    cache_hub_dataset(root / "hf", "mit-han-lab/pile-val-backup", {"validation": {"text": chunks}})
    model = root / "tiny-llama"
    shutil.copytree(trained_model_dir(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return root, model


@pytest.mark.parametrize(("script", "save_dir", "method"), [
    ("gptq_w4a16_ultrachat.py", "tiny-llama-W4A16-G128", "pack-quantized"),
    ("fp8_dynamic.py", "tiny-llama-FP8-Dynamic", "float-quantized"),
    ("awq_w4a16.py", "tiny-llama-awq-asym", "pack-quantized"),
])
def test_example_runs_with_imports_changed(setting, tmp_path, script, save_dir, method):
    root, model = setting
    source = (EXAMPLES / script).read_text(encoding="utf-8")
    changed = source
    for theirs, ours in IMPORTS.items():
        changed = changed.replace(theirs, ours)
    changed = re.sub(r'^MODEL_ID = ".*"$', f"MODEL_ID = {str(model)!r}", changed, flags=re.M)
    assert [line for line in changed.splitlines() if line.startswith(("from llmcompressor", "import llmcompressor"))] == []
    differing = [a for a, b in zip(source.splitlines(), changed.splitlines()) if a != b]
    assert all(a.startswith(("from llmcompressor", "MODEL_ID =")) for a in differing), differing
    (tmp_path / script).write_text(changed, encoding="utf-8")
    env = {**os.environ, "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SAMPLE GENERATION" in done.stdout
    config = json.loads((tmp_path / save_dir / "config.json").read_text())["quantization_config"]
    assert config["format"] == method and config["ignore"] == ["lm_head"]
    reloaded = llmpress.load(tmp_path / save_dir)
    assert reloaded is not None
