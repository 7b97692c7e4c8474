"""What the benchmark drivers and their worker processes share (stdlib and lazy imports only, so
it also runs in the peers' virtual environment)."""

from __future__ import annotations

import os
import resource
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "fixtures"
PEER_VENV = REPO / ".venv-peers"  # llm-compressor 0.14, apart from our pins
#: LLMPRESS_PEER_PYTHON: an interpreter that already has llm-compressor (a GPU machine's own
#: Python, say), instead of the one in .venv-peers
PEER_PYTHON = Path(os.environ.get("LLMPRESS_PEER_PYTHON") or PEER_VENV / "bin" / "python")


def work_folder(given: str | None, prefix: str) -> Path:
    """The benchmark's folder for checkpoints: ``given``, else a new temporary one."""
    import tempfile

    work = Path(given or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return work


def fixture(*parts: str) -> Path:
    """A shared fixture, else the bundled copy in assets/."""
    shared = SHARED.joinpath(*parts)
    return shared if shared.exists() else REPO.joinpath("assets", *parts)


def save_random_llama(folder: Path, tokenizer_dir: Path | None = None, dtype: str = "float32", **config) -> Path:
    """A randomly initialised Llama built from ``LlamaConfig(**config)`` (seed 0, untied
    embeddings unless ``config`` ties them), saved as ``dtype`` safetensors once (built in that dtype: a bf16 model never
    exists in fp32); ``tokenizer_dir``'s tokenizer is copied beside it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        model = LlamaForCausalLM(LlamaConfig(**{"tie_word_embeddings": False, **config}))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(str(folder))
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(folder))
    return folder


def peer_calibration(samples: list[list[int]]) -> dict:
    """llm-compressor's ``oneshot`` keywords for calibrating on exactly these token ids (each
    sample whole, all of them)."""
    from datasets import Dataset

    dataset = Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]})
    return dict(dataset=dataset, num_calibration_samples=len(samples), max_seq_length=len(samples[0]))


def let_peer_awq_run_without_gpu() -> None:
    """llm-compressor's AWQ pins host memory for GPU copies, which fails without a GPU: a
    transfer detail, not the algorithm (no GPU, nothing to copy to), so pinning is made a no-op
    in the peer's process when no GPU is there."""
    import torch

    if not torch.cuda.is_available():
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def peak_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: on Linux ru_maxrss keeps the high-water
    mark of the parent at fork, so a child started by a big parent would report the parent's."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_gpu_mb() -> float:
    """This process's peak of CUDA memory held by PyTorch's tensors (``max_memory_allocated``), 0
    where it never used a GPU. The allocator's cache on top of it is not counted: both tools
    allocate through it alike."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**20


def median_run(runs: list[dict]) -> dict:
    """Per-figure medians over repeated runs."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def prefill_seconds(model, tokens: int, runs: int = 3) -> float:
    """One forward of a batch-1 prompt of ``tokens`` random ids (no cache, last logits only): the
    median of ``runs`` after a warm-up."""
    import time

    import torch

    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
    times = []
    with torch.no_grad():
        for _ in range(runs + 1):
            start = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def pair_cells(row: dict, figures: tuple[str, ...] = ("compress_s", "rss_mb")) -> str:
    """A ``run_pairs`` row's figures as table cells: ``llmpress/llm-compressor ratio`` each
    (seconds to one decimal, megabytes whole)."""
    ours, peer, ratios = row["ours"], row["peer"], row["ratios"]
    cells = []
    for key in figures:
        if key in ("rss_mb", "gpu_mb"):
            cells.append(f"{ours[key]:>7.0f}/{peer[key]:<7.0f} {ratios[key]:>6.2f}")
        else:
            cells.append(f"{ours[key]:>6.1f}/{peer[key]:<6.1f} {ratios[key]:>6.2f}")
    return " ".join(cells)
