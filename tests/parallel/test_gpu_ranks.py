"""Ranks that calibrate on a GPU (issue 45's first part): under ``torchrun`` on a GPU machine each
rank takes GPU ``LOCAL_RANK`` and reduces on NCCL, or, where ranks share a GPU, on gloo through
host memory. The collectives' staging runs everywhere; the end-to-end run needs a CUDA GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers import GPTQ_W4_G32, REPO, text_path, trained_model_dir

from llmpress.parallel import distributed

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(("backend", "device", "takes"), [
    ("gloo", "cpu", True), ("gloo", "cuda", False), ("nccl", "cuda", True), ("nccl", "cpu", False),
    ("cpu:gloo,cuda:nccl", "cpu", True), ("cpu:gloo,cuda:nccl", "cuda", True),
])
def test_a_tensor_crosses_where_the_backend_takes_it(monkeypatch, backend, device, takes):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert distributed._backend_takes(SimpleNamespace(device=torch.device(device))) is takes


def test_a_collective_runs_on_a_copy_the_backend_takes(monkeypatch):
    """A tensor that is not contiguous is reduced through a contiguous copy, and the result comes
    back into it; a contiguous one the backend takes is reduced in place. (The crossing to
    another device, a CUDA tensor on gloo, runs the same path; it needs a GPU to run.)"""
    seen = []

    def all_reduce(t, op=None):
        seen.append((t.device.type, t.is_contiguous()))
        t.mul_(2)

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    transposed = torch.arange(6.0).reshape(2, 3).t()
    distributed.sum_across_ranks(transposed)
    assert seen == [("cpu", True)] and torch.equal(transposed, 2 * torch.arange(6.0).reshape(2, 3).t())
    plain = torch.ones(3)
    distributed.sum_across_ranks(plain)
    assert seen[-1] == ("cpu", True) and torch.equal(plain, torch.full((3,), 2.0))


def _perplexity(checkpoint) -> float:
    import llmpress
    from llmpress.evaluation import evaluation_windows, perplexity

    model = llmpress.load(checkpoint, dequantize=True).float()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    windows = evaluation_windows(text_path("evaluation.txt").read_text(encoding="utf-8"), tokenizer, 256, 40)
    return perplexity(model, windows, progress=False).perplexity


@cuda
def test_two_ranks_on_the_gpu_give_the_one_process_perplexity(tmp_path):
    """``torchrun --nproc-per-node 2`` on a GPU machine: each rank calibrates its share on its GPU
    (both on one GPU where there is one: gloo, through host memory) and the checkpoint reads
    within 0.1% of one process's perplexity (float sums in another order on the GPU)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(GPTQ_W4_G32)
    common = ["-v", "oneshot", "--model", str(trained_model_dir()), "--recipe", str(recipe), "--dataset",
              str(text_path("calibration.txt")), "--num-samples", "16", "--seq-len", "256"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                            "llmpress", *common, "--output", str(tmp_path / "two")], env=env, capture_output=True, text=True,
                           timeout=600)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    backend = "gloo" if torch.cuda.device_count() < 2 else "cpu:gloo,cuda:nccl"  # ranks sharing one GPU: through host memory
    assert f"rank 0 of 2 ({backend}, calibrating on cuda:0)" in ranks.stderr
    one = subprocess.run([sys.executable, "-m", "llmpress", *common, "--output", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two_ppl, one_ppl = _perplexity(tmp_path / "two"), _perplexity(tmp_path / "one")
    print(f"GPTQ W4A16 g32 on the GPU: one process {one_ppl:.4f}, two ranks {two_ppl:.4f}")
    assert abs(two_ppl - one_ppl) / one_ppl < 0.001
