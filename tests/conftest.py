"""Shared fixtures: tiny models built in-process, the trained model, and a stray-file guard."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures"
ASSETS = REPO / "assets"

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def trained_model_dir() -> Path:
    """The small trained Llama: the shared fp32 fixture when present, else the bundled bf16 copy."""
    shared = SHARED_FIXTURES / "tiny-llama"
    return shared if (shared / "model.safetensors").exists() else ASSETS / "tiny-llama"


def text_path(name: str) -> Path:
    shared = SHARED_FIXTURES / "text" / name
    return shared if shared.exists() else ASSETS / "text" / name


@contextmanager
def gloo_rank(rank: int, world: int, init: str) -> Iterator[None]:
    """One spawned rank of a gloo group for the length of a ``with`` block, one thread each; the
    group is ended with a barrier first when the block finished (``end_process_group``)."""
    from llmpress.parallel.distributed import end_process_group

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    finished = False
    try:
        yield
        finished = True
    finally:
        end_process_group(wait_for_others=finished)


def make_tiny_llama(seed: int = 0, *, tie: bool = False, intermediate: int = 200, bias: bool = False):
    """A random 2-layer Llama. ``intermediate=200`` makes down_proj's column count not a multiple of 128."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        attention_bias=bias,
    )
    return LlamaForCausalLM(config).eval()


def sparsity_record(folder: Path) -> dict:
    """The sparsity record of a pruned, unquantized checkpoint: a plain checkpoint (no
    quantization_config, which transformers + compressed-tensors would refuse) with llmpress's key."""
    import json

    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    return config["llmpress_sparsity"]


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint's shards, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in Path(folder).glob("*.safetensors"):
        out.update(load_file(str(file)))
    return out


#: GPTQ W4A16 in groups of 32 (the tiny models' widths), lm_head dense, in llm-compressor's grammar
GPTQ_W4_G32 = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}
"""


def token_batches(count: int = 4, length: int = 32, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def trained_llama():
    """The small trained Llama in float32, for evaluation."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(trained_model_dir()), dtype=torch.float32).eval()


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


# -- training loops for the session tests --------------------------------------------------
def training_batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(seed))


def train_steps(session, model, optimizer, steps: int, *, same_batch: bool = False) -> list[float]:
    model.train()
    losses = []
    for i in range(steps):
        batch = training_batch(0 if same_batch else i)
        with session.training_step() as step:
            loss = step.loss(model(input_ids=batch, labels=batch).loss)
            loss.backward()
            step.optimizer_step(optimizer)
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
