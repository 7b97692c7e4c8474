"""What the tests share: tiny models built in-process, the trained model and its text, token
batches, checkpoint readers, gloo ranks and small training loops. (``conftest.py`` holds the
pytest fixtures; test files import these with ``from helpers import ...``.)"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

import llmpress

REPO = Path(__file__).resolve().parent.parent  # tests/ is right under the repository
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures"
ASSETS = REPO / "assets"



def trained_model_dir() -> Path:
    """The small trained Llama: the shared fp32 fixture when present, else the bundled bf16 copy."""
    shared = SHARED_FIXTURES / "tiny-llama"
    return shared if (shared / "model.safetensors").exists() else ASSETS / "tiny-llama"


def text_path(name: str) -> Path:
    shared = SHARED_FIXTURES / "text" / name
    return shared if shared.exists() else ASSETS / "text" / name


@contextmanager
def gloo_rank(rank: int, world: int, init: str) -> Iterator[None]:
    """One spawned rank of a gloo group for the length of a ``with`` block, one thread each, the
    block being the whole of the rank's function: the group is ended with a barrier first when
    the block finished (``end_process_group``), and then the rank exits at once (``os._exit(0)``,
    output flushed) instead of returning to the interpreter's shutdown.

    That shutdown is where a rank died of SIGABRT once in CI (the FSDP fixture, process 1):
    an FSDP model's device mesh holds its process group (``DeviceMesh._pg_registry``) and
    DTensor's sharding cache keeps the mesh to the end, so the gloo group's C++ side is only
    destroyed during interpreter finalization, where (a PyTorch pull request, pytorch#179291, says)
    gloo's threads can abort the process. What the tests check is done and written by then; an
    error inside the block still propagates to ``mp.spawn`` with its traceback."""
    import os
    import sys

    from llmpress.parallel.distributed import end_process_group

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    finished = False
    try:
        yield
        finished = True
    finally:
        end_process_group(wait_for_others=finished)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    """The sparsity record of a pruned checkpoint, under llmpress's config key. A quantized one's
    ``sparsity_config`` is empty, as compressed-tensors writes it (vLLM refuses one with targets);
    an unquantized one is a plain checkpoint (no quantization_config, which transformers +
    compressed-tensors would refuse)."""
    import json

    config = json.loads((folder / "config.json").read_text())
    assert config.get("quantization_config", {"sparsity_config": {}})["sparsity_config"] == {}
    return config["llmpress_sparsity"]


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """A causal LM's logits for ``ids``, in float32, without gradients."""
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


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


# -- GPTQ problems, other families, interrupted runs ---------------------------------------
def correlated_problem(rows=96, cols=256, samples=2048, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, cols, generator=generator) @ torch.randn(cols, cols, generator=generator) / cols**0.5
    w = torch.randn(rows, cols, generator=generator)
    return w, x, 2 * x.t() @ x / samples


def output_error(w, q, x):
    return float(((q - w) @ x.t()).pow(2).mean())


def tiny_of_family(arch: str) -> torch.nn.Module:
    """A tiny random model of one of a few families whose blocks differ from a Llama's (seed 0)."""
    import transformers as T

    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    torch.manual_seed(0)
    return {
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(**{**common, "ffn_dim": 128, "word_embed_proj_dim": 64})),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**common)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**common, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=1)),
        "qwen3_moe": lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**common, num_key_value_heads=2, num_experts=4,
                                                                    num_experts_per_tok=2, moe_intermediate_size=64)),
        "bert": lambda: T.BertForMaskedLM(T.BertConfig(**common)),  # an encoder: bidirectional mask, token types
    }[arch]().eval()


def four_layers():
    """A random 4-layer Llama (seed 0): enough layers to stop a run in the middle of."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


class Stop(Exception):
    """Raised to stop a run as a crash would."""


def oneshot_stopping_after(tmp_path, out, *, recipe, options, stop_after=None, resume=False, samples=None, monkeypatch=None,
                           overwrite=False):
    """``oneshot`` of ``tmp_path/model`` into ``out``, raising ``Stop`` once layer ``stop_after`` is saved (a crash)."""
    from llmpress.pipelines.storage.resume import WorkFolder

    if stop_after is not None:
        original = WorkFolder.save_layer

        def save_then_stop(self, index, *args):
            original(self, index, *args)
            if index == stop_after:
                raise Stop

        monkeypatch.setattr(WorkFolder, "save_layer", save_then_stop)
    try:
        return llmpress.oneshot(str(tmp_path / "model"), recipe, samples or token_batches(count=6), output_dir=out,
                                calibration=options, resume=resume, overwrite=overwrite)
    finally:
        if stop_after is not None:
            monkeypatch.setattr(WorkFolder, "save_layer", original)


def hf_fp8_copy(source: Path, folder: Path) -> Path:
    """``source`` as a Hugging Face ``quant_method: fp8`` checkpoint (DeepSeek-V3's layout: fp8
    weights, a float32 ``weight_scale_inv`` per 128 x 128 block, lm_head dense), made from
    llmpress's FP8_BLOCK output, which is the same grid under compressed-tensors' names."""
    import json

    from safetensors.torch import load_file, save_file

    llmpress.oneshot(source, "FP8_BLOCK", output_dir=folder, model_free=False)
    weights = folder / "model.safetensors"
    tensors = {(k.replace(".weight_scale", ".weight_scale_inv")): v.float() if k.endswith(".weight_scale") else v
               for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                                     "modules_to_not_convert": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "recipe.yaml").unlink()
    return folder
