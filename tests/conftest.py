"""The pytest fixtures (helpers every test may import are in ``helpers.py``)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import REPO, make_tiny_llama, text_path, trained_model_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs ``-n auto``) each worker takes its share of the
    cores, and so do the processes its tests start: workers times threads stays the number of
    cores. (Two workers of two threads each on two cores ran the suite slower than one process
    of two; two of one thread each, 1.5x faster.)"""
    from llmpress.parallel.fork import _threads_per_rank  # the cores shared out as --ranks shares them

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    threads = _threads_per_rank(workers) if workers > 1 else None  # None where OMP_NUM_THREADS says already
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained_data():
    """The trained model's calibration text (a path), its tokenizer, and 40 evaluation windows
    of 256 tokens."""
    from transformers import AutoTokenizer

    from llmpress.evaluation import evaluation_windows

    tokenizer = AutoTokenizer.from_pretrained(str(trained_model_dir()))
    windows = evaluation_windows(text_path("evaluation.txt").read_text(), tokenizer, 256, 40)
    return str(text_path("calibration.txt")), tokenizer, windows


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture
def scoped_registries():
    """Modifiers, formats and quantization methods a test registers are forgotten after it."""
    from llmpress.formats import FORMATS
    from llmpress.loading import METHODS
    from llmpress.loading.transformers_quantizer import unregister_from_transformers
    from llmpress.modifiers import MODIFIERS

    before = {registry: set(registry.names()) for registry in (MODIFIERS, FORMATS, METHODS)}
    yield
    for registry, names in before.items():
        for name in set(registry.names()) - names:
            registry.unregister(name)
            if registry is METHODS:
                unregister_from_transformers(name)


@pytest.fixture(autouse=True)
def no_stray_files():
    """Fail a test that leaves files behind in the repository (tests write under tmp_path)."""
    before = set(os.listdir(REPO))
    yield
    stray = set(os.listdir(REPO)) - before - {".pytest_cache"}
    assert not stray, f"test left stray files in the repository: {sorted(stray)}"
