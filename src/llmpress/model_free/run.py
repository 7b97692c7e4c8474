"""Data-free quantization straight from the safetensors shards: no model class, no model in memory.

The source's tensors are read shard by shard in file order (memory-mapped where their dtype is
kept); each quantized weight is rounded and compressed by the same functions the model-class
path uses (``attach.store_weight_qparams``, the format codecs), so the two paths write the same tensors
(the same file, where the output is one shard). Weights are processed by a pool of worker
threads (torch releases the interpreter lock in its kernels), a bounded number ahead of the
writer, and the results go to ``ShardedWriter`` (``tensorfiles/write.py``), which keeps a few of
them in memory and the rest of the shard being gathered in a scratch file: memory holds a few
tensors whatever the checkpoint's size. The folder appears whole or not at all
(``atomic_directory``), beside the config (``quantization_config`` added, and ``dtype`` where it
changed), the recipe, and every other file of the source (tokenizer, generation config, code).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.checkpoint.atomic import atomic_directory
from llmpress.checkpoint.compressed_state import name_experts, quantization_config_of
from llmpress.checkpoint.output import RECORD_NAME, claimed_output, write_record
from llmpress.checkpoint.save import RECIPE_NAME, is_checkpoint_file
from llmpress.compat import own_buffers, own_parameters
from llmpress.formats import FORMATS, format_for
from llmpress.formats.hf_fp8 import SCALE_NAME, dequantize_fp8, fp8_source_args
from llmpress.lifecycle.attach import attach_scheme, set_module_buffer, store_weight_qparams
from llmpress.memory import parse_size, release_free_memory
from llmpress.model_free.plan import ModelFreePlan, plan_model_free
from llmpress.quant.observers import weight_global_scale
from llmpress.quant.scheme import QuantizationScheme
from llmpress.recipe import Recipe
from llmpress.tensorfiles.folder import model_folder
from llmpress.tensorfiles.read import ShardEntry, stream_tensors
from llmpress.tensorfiles.write import INDEX_NAME, ShardedWriter

__all__ = ["default_workers", "quantize_model_free", "run_plan"]

logger = logging.getLogger(__name__)


def default_workers() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def quantize_model_free(model: str | Path, recipe, output_dir: str | Path, *, dtype: torch.dtype | None = None,
                        workers: int | None = None, max_shard_size: int | str = "1GB", overwrite: bool = False) -> Path:
    """Quantize the checkpoint ``model`` (a folder or cached Hub id) with a data-free ``recipe``
    (one QuantizationModifier whose schemes need no calibration: FP8_DYNAMIC, FP8_BLOCK, W4A16 /
    W8A16 / W8A8 dynamic, NVFP4A16, MXFP4A16) into ``output_dir``, shard by shard, without
    building the model. ``dtype``: the dtype unquantized tensors and scales are written in (by
    default the checkpoint's own). Raises ``ModelFreeRefused`` (a ``RecipeError``) where the
    recipe or checkpoint needs the model class (``plan.py``). The output's shards hold at most
    ``max_shard_size`` each. ``overwrite``: as in ``oneshot``."""
    folder = model_folder(model)
    recipe = Recipe.from_any(recipe)
    with claimed_output(output_dir, folder, overwrite):
        return run_plan(plan_model_free(folder, recipe, dtype), recipe, output_dir, workers=workers, max_shard_size=max_shard_size)


def run_plan(plan: ModelFreePlan, recipe: Recipe, output_dir: str | Path, *, workers: int | None = None,
             max_shard_size: int | str = "1GB") -> Path:
    """``quantize_model_free`` once its plan is made and its output checked (``oneshot`` made both)."""
    workers = workers or default_workers()
    source = _Source(plan)
    scales = _GlobalScales(plan, source)
    total = sum(len(entries) for entries in plan.shards.values())
    with atomic_directory(output_dir, replaces=is_checkpoint_file) as tmp, ThreadPoolExecutor(workers) as pool, \
            tqdm(total=total, desc="Quantizing tensors", unit="tensor") as bar:
        output = ShardedWriter(tmp, parse_size(max_shard_size))
        try:
            for path, entries in plan.shards.items():
                _quantize_shard(path, entries, plan, source, scales, pool, workers, output, bar)
            output.finish()
        except BaseException:
            output.abort()
            raise
        _write_config(tmp, plan)
        (tmp / RECIPE_NAME).write_text(recipe.to_yaml(), encoding="utf-8")
        _copy_other_files(plan.folder, tmp)
        write_record(tmp)
    logger.info("saved compressed checkpoint to %s (model-free: %d quantized weights)", output_dir, len(plan.schemes))
    return Path(output_dir)


def _quantize_shard(path: Path, entries: list[ShardEntry], plan: ModelFreePlan, source: _Source, scales: _GlobalScales,
                    pool: ThreadPoolExecutor, workers: int, output: ShardedWriter, bar) -> None:
    """One source shard's tensors, in file order, into ``output``."""
    pending: deque[Future] = deque()

    def drain(limit: int) -> None:
        while len(pending) > limit:
            for name, tensor in pending.popleft().result().items():
                output.add(name, tensor)
            release_free_memory()  # the workers' temporaries and the written tensors go back, not kept in their heaps
            bar.update()

    for entry, read in stream_tensors(path, entries, prefetch=True):  # read ahead while the workers round
        if plan.skipped(entry.name):
            bar.update()
            continue
        scheme = plan.schemes.get(entry.name)
        tensor = source.dense(entry.name, read)
        if scheme is None:
            pending.append(_done({entry.name: tensor}))
        else:
            pending.append(pool.submit(_quantize, entry.name, tensor, scheme, scales.of(entry.name)))
        drain(2 * workers)  # a bounded number of weights in flight
    drain(0)


def _done(value: dict[str, torch.Tensor]) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


#: a weight is quantized this many bytes of its rows at a time (in its own dtype), so that its
#: float32 temporaries stay a few cache-friendly MB, not several copies of a 300 MB weight
ROWS_BYTES = 2 << 20
_PACKED_ROWS = 128  # a multiple of every row packing and block height of the data-free schemes


def _quantize(name: str, weight: torch.Tensor, scheme: QuantizationScheme,
              global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """``weight`` rounded and compressed as the model-class path does it, under ``name``'s
    module, a band of rows at a time where its scheme's scales are per row, group or block (each
    row's result is the same whichever rows it is computed with)."""
    args = scheme.weights
    step = _rows_per_band(weight, args)
    if step >= weight.shape[0]:
        return _quantize_rows(name, weight, scheme, global_scale)
    if global_scale is None and args.strategy == "tensor_group":  # NVFP4 alone: its own, from the whole weight
        global_scale = weight_global_scale([weight])
    bands = [_quantize_rows(name, weight[first : first + step], scheme, global_scale) for first in range(0, weight.shape[0], step)]
    joined = {}
    for key, first in bands[0].items():
        if key.endswith("weight_shape"):
            joined[key] = torch.tensor(list(weight.shape), dtype=first.dtype)
        elif key.endswith("weight_global_scale"):
            joined[key] = first
        else:
            joined[key] = torch.cat([band[key] for band in bands])
    return joined


def _rows_per_band(weight: torch.Tensor, args) -> int:
    """How many rows of ``weight`` are quantized at once: all of them for a per-tensor scale."""
    if weight.dim() != 2 or args.strategy == "tensor" or args.uses_mse:  # MSE stops its search on the whole tensor's units
        return weight.shape[0]
    height = math.lcm(_PACKED_ROWS, (args.block_structure or [1])[0]) if args.strategy == "block" else _PACKED_ROWS
    return max(height, ROWS_BYTES // max(1, weight.shape[1] * weight.element_size()) // height * height)


def _quantize_rows(name: str, weight: torch.Tensor, scheme: QuantizationScheme,
                   global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    module = nn.Module()
    module.weight = nn.Parameter(weight, requires_grad=False)
    attach_scheme(module, scheme)
    if global_scale is not None:
        set_module_buffer(module, "weight_global_scale", global_scale.clone())
    store_weight_qparams(module)  # the compressor rounds the weight as it packs it: the integers freeze_weight gives
    local = {k: v.detach() for k, v in {**own_parameters(module), **own_buffers(module)}.items() if v is not None}
    compressed = FORMATS.get(format_for(scheme)).compress(local, scheme)
    prefix = name.rpartition(".")[0]
    return {f"{prefix}.{k}": v for k, v in compressed.items()}


class _Source:
    """The checkpoint's tensors as the recipe sees them: in ``plan.dtype`` where it names one,
    a Hugging Face fp8 weight dense (times its block scales, ``formats/hf_fp8.py``)."""

    def __init__(self, plan: ModelFreePlan) -> None:
        self.plan = plan
        self.where = {e.name: (path, e) for path, entries in plan.shards.items() for e in entries}
        self.fp8_args = fp8_source_args(plan.fp8_block) if plan.fp8_weights else None

    def dense(self, name: str, read) -> torch.Tensor:
        """The tensor ``name``, from its reader (``stream_tensors``)."""
        scale = self.plan.fp8_weights.get(name)
        if scale is not None:
            return dequantize_fp8(read(), self.by_name(scale), self.fp8_args, self.plan.fp8_dtype)
        return read(self.plan.dtype if self.where[name][1].dtype.is_floating_point else None)

    def by_name(self, name: str) -> torch.Tensor:
        """The tensor ``name`` on its own, dense (a family member, an fp8 weight's scale)."""
        path, entry = self.where[name]
        for _, read in stream_tensors(path, [entry]):  # the file is open while the loop runs
            return read() if name.endswith(f".{SCALE_NAME}") else self.dense(name, read)
        raise AssertionError(f"{name} is not in {path}")


class _GlobalScales:
    """Each NVFP4 fused family's shared global scale, computed when its first member comes up:
    its members are read then (their neighbours in the file, so the main pass finds them in the
    page cache), not in a pass of their own over the checkpoint."""

    def __init__(self, plan: ModelFreePlan, source: _Source) -> None:
        self.families, self.source = plan.families, source
        self.known: dict[str, torch.Tensor] = {}

    def of(self, name: str) -> torch.Tensor | None:
        members = self.families.get(name)
        if members is None:
            return None
        if name not in self.known:
            shared = weight_global_scale([self.source.by_name(m) for m in members])
            self.known.update(dict.fromkeys(members, shared))
        return self.known[name]


def _write_config(folder: Path, plan: ModelFreePlan) -> None:
    config = dict(plan.config)
    named = name_experts([(name.removesuffix(".weight"), scheme) for name, scheme in plan.schemes.items()])
    config["quantization_config"] = quantization_config_of(named, plan.ignore)
    dtype = plan.dtype or (plan.fp8_dtype if plan.fp8_weights else None)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
        config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _copy_other_files(source: Path, target: Path) -> None:
    """The source's files that are not weights, the index or the config: tokenizer, generation
    config, the model's own code."""
    for path in source.iterdir():
        name = path.name
        weights = name.endswith((".safetensors", ".bin", ".bin.index.json", ".pt", ".pth"))
        if path.is_file() and not weights and name not in (INDEX_NAME, "config.json", RECIPE_NAME, RECORD_NAME):
            shutil.copy2(path, target / name)
