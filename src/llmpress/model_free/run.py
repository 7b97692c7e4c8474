"""Data-free quantization straight from the safetensors shards: no model class, no model in memory.

The source's tensors are read shard by shard in file order (memory-mapped where their dtype is
kept); each quantized weight is rounded and compressed by the same functions the model-class
path uses (``attach.freeze_weight``, the format codecs), so the two paths write the same tensors
(the same file, where the output is one shard). Results are gathered up to ``max_shard_size``
and written as one output shard (``tensorfiles.write``), each tensor let go once written. Weights are processed by a pool of worker threads (torch
releases the interpreter lock in its kernels), a bounded number ahead of the writer, so memory
holds a few tensors whatever the checkpoint's size. The folder appears whole or not at all
(``atomic_directory``), beside the config (``quantization_config`` added, and ``dtype`` where it
changed), the recipe, and every other file of the source (tokenizer, generation config, code).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.checkpoint.atomic import atomic_directory
from llmpress.checkpoint.compressed_state import quantization_config_of
from llmpress.checkpoint.output import check_output
from llmpress.checkpoint.save import INDEX_NAME, RECIPE_NAME, WEIGHTS_NAME, is_checkpoint_file, parse_size
from llmpress.formats import FORMATS, format_for
from llmpress.lifecycle.attach import attach_scheme, freeze_weight, set_module_buffer
from llmpress.model_free.plan import ModelFreePlan, plan_model_free
from llmpress.quant.observers import weight_global_scale
from llmpress.quant.scheme import QuantizationScheme
from llmpress.recipe import Recipe
from llmpress.tensorfiles.folder import model_folder
from llmpress.tensorfiles.read import ShardEntry, stream_tensors
from llmpress.tensorfiles.write import TensorFileBuilder

__all__ = ["default_workers", "quantize_model_free"]

logger = logging.getLogger(__name__)


def default_workers() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def quantize_model_free(model: str | Path, recipe, output_dir: str | Path, *, dtype: torch.dtype | None = None,
                        workers: int | None = None, max_shard_size: int | str = "1GB", plan: ModelFreePlan | None = None) -> Path:
    """Quantize the checkpoint ``model`` (a folder or cached Hub id) with a data-free ``recipe``
    (one QuantizationModifier whose schemes need no calibration: FP8_DYNAMIC, FP8_BLOCK, W4A16 /
    W8A16 / W8A8 dynamic, NVFP4A16, MXFP4A16) into ``output_dir``, shard by shard, without
    building the model. ``dtype``: the dtype unquantized tensors and scales are written in (by
    default the checkpoint's own). Raises ``ModelFreeRefused`` (a ``RecipeError``) where the
    recipe or checkpoint needs the model class (``plan.py``). The output's shards hold at most
    ``max_shard_size`` each (gathered in memory before each is written: the run's memory is
    a few tensors: what waits for its shard to be written goes to a scratch file)."""
    folder = model_folder(model)
    recipe = Recipe.from_any(recipe)
    check_output(output_dir, folder)
    plan = plan or plan_model_free(folder, recipe, dtype)
    workers = workers or default_workers()
    global_scales = _family_global_scales(plan)
    total = sum(len(entries) for entries in plan.shards.values())
    with atomic_directory(output_dir, replaces=is_checkpoint_file) as tmp, ThreadPoolExecutor(workers) as pool, \
            tqdm(total=total, desc="Quantizing tensors", unit="tensor") as bar:
        output = _OutputShards(tmp, parse_size(max_shard_size))
        for path, entries in plan.shards.items():
            _quantize_shard(path, entries, plan, global_scales, pool, workers, output, bar)
        output.finish()
        _write_config(tmp, plan)
        (tmp / RECIPE_NAME).write_text(recipe.to_yaml(), encoding="utf-8")
        _copy_other_files(plan.folder, tmp)
    logger.info("saved compressed checkpoint to %s (model-free: %d quantized weights)", output_dir, len(plan.schemes))
    return Path(output_dir)


def _quantize_shard(source: Path, entries: list[ShardEntry], plan: ModelFreePlan, global_scales: dict[str, torch.Tensor],
                    pool: ThreadPoolExecutor, workers: int, output: _OutputShards, bar) -> None:
    """One source shard's tensors, in file order, into ``output``."""
    pending: deque[Future] = deque()

    def drain(limit: int) -> None:
        while len(pending) > limit:
            for name, tensor in pending.popleft().result().items():
                output.add(name, tensor)
            bar.update()

    for entry, read in stream_tensors(source, entries):
        scheme = plan.schemes.get(entry.name)
        convert = plan.dtype if entry.dtype.is_floating_point and plan.dtype is not None else None
        tensor = read(convert)
        if scheme is None:
            pending.append(_done({entry.name: tensor}))
        else:
            pending.append(pool.submit(_quantize, entry.name, tensor, scheme, global_scales.get(entry.name)))
        drain(2 * workers)  # a bounded number of weights in flight
    drain(0)


class _OutputShards:
    """The output's tensors, gathered up to ``limit`` bytes and then written as one shard
    (``TensorFileBuilder``: little of it in memory), named as ``save_checkpoint`` names them once
    their number is known."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0
        self.current = self._builder()

    def _builder(self) -> TensorFileBuilder:
        return TensorFileBuilder(self.folder / f".part-{len(self.parts):05d}.scratch")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if len(self.current) and self.current.nbytes + tensor.numel() * tensor.element_size() > self.limit:
            self._flush()
        self.current.add(name, tensor)

    def _flush(self) -> None:
        path = self.folder / f".part-{len(self.parts):05d}.safetensors"
        names = self.current.names()
        self.total += self.current.write(path, {"format": "pt"})
        self.parts.append((path, names))
        self.current = self._builder()

    def finish(self) -> None:
        if len(self.current) or not self.parts:
            self._flush()
        if len(self.parts) == 1:
            self.parts[0][0].rename(self.folder / WEIGHTS_NAME)
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.parts, start=1):
            filename = f"model-{i:05d}-of-{len(self.parts):05d}.safetensors"
            path.rename(self.folder / filename)
            weight_map.update(dict.fromkeys(names, filename))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2), encoding="utf-8")


def _done(value: dict[str, torch.Tensor]) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _quantize(name: str, weight: torch.Tensor, scheme: QuantizationScheme,
              global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """``weight`` rounded and compressed as the model-class path does it, under ``name``'s module."""
    module = nn.Module()
    module.weight = nn.Parameter(weight, requires_grad=False)
    attach_scheme(module, scheme)
    if global_scale is not None:
        set_module_buffer(module, "weight_global_scale", global_scale.clone())
    freeze_weight(module)
    local = {k: v for k, v in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]}
    compressed = FORMATS.get(format_for(scheme)).compress({k: v.detach() for k, v in local.items()}, scheme)
    prefix = name.rpartition(".")[0]
    return {f"{prefix}.{k}": v for k, v in compressed.items()}


def _family_global_scales(plan: ModelFreePlan) -> dict[str, torch.Tensor]:
    """The shared NVFP4 global scale of each fused family's weights (read once, before the shards)."""
    if not plan.families:
        return {}
    where = {e.name: (path, e) for path, entries in plan.shards.items() for e in entries}
    scales: dict[str, torch.Tensor] = {}
    for members in dict.fromkeys(plan.families.values()):
        weights = [_read_one(*where[m], plan.dtype) for m in members]
        shared = weight_global_scale(weights)
        scales.update(dict.fromkeys(members, shared))
    return scales


def _read_one(path: Path, entry: ShardEntry, dtype: torch.dtype | None) -> torch.Tensor:
    for _, read in stream_tensors(path, [entry]):
        return read(dtype)
    raise AssertionError("unreachable")


def _write_config(folder: Path, plan: ModelFreePlan) -> None:
    config = dict(plan.config)
    config["quantization_config"] = quantization_config_of(list(plan.schemes.values()), plan.ignore)
    if plan.dtype is not None:
        config["dtype"] = str(plan.dtype).removeprefix("torch.")
        config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _copy_other_files(source: Path, target: Path) -> None:
    """The source's files that are not weights, the index or the config: tokenizer, generation
    config, the model's own code."""
    for path in source.iterdir():
        name = path.name
        weights = name.endswith((".safetensors", ".bin", ".bin.index.json", ".pt", ".pth"))
        if path.is_file() and not weights and name not in (INDEX_NAME, "config.json", RECIPE_NAME, "llmpress_run.json"):
            shutil.copy2(path, target / name)
