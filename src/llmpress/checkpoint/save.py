"""The one save path: every checkpoint llmpress writes goes through ``save_checkpoint``."""

from __future__ import annotations

import copy
import logging
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmpress.checkpoint.atomic import atomic_directory
from llmpress.checkpoint.compressed_state import (
    compressed_state_dict,
    quantization_config_for,
)
from llmpress.checkpoint.output import RECORD_NAME, check_output, write_record
from llmpress.checkpoint.sparsity import SPARSITY_KEY, sparsity_config_for
from llmpress.errors import CheckpointError
from llmpress.lifecycle.records import applied_recipe
from llmpress.memory import parse_size
from llmpress.models.keys import KeyMap
from llmpress.parallel.fsdp import is_sharded, unwrap_if_fsdp
from llmpress.tensorfiles.write import ShardedWriter

if TYPE_CHECKING:
    from llmpress.recipe import Recipe

__all__ = ["save_checkpoint"]

logger = logging.getLogger(__name__)

RECIPE_NAME = "recipe.yaml"
#: the weight files of a checkpoint, as transformers names them (``model_final.safetensors`` is not one)
_WEIGHT_FILE = re.compile(r"(model|pytorch_model)((-\d{5}-of-\d{5})?\.(safetensors|bin)|\.(safetensors|bin)\.index\.json)")


def save_checkpoint(
    output_dir: str | Path,
    model: nn.Module,
    processor: Any = None,
    *,
    save_compressed: bool = True,
    recipe: Recipe | None = None,
    max_shard_size: int | str = "5GB",
    synchronize: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` (compressed when it is quantized), its config, tokenizer, recipe and
    remote-code files to ``output_dir``, atomically. Returns the folder.

    ``recipe`` replaces the model's own record of how it was made (the recipe it was loaded
    with followed by the stages applied since), which is what ``recipe.yaml`` holds otherwise.
    Under ``torch.distributed`` every rank calls it and the main one writes; with
    ``synchronize=False`` only the caller's rank is here (a Trainer saving on its main process)
    and it writes without waiting for the others. A model sharded by FSDP is gathered for the
    save (``unwrap_if_fsdp``: every rank takes part), or, without ``synchronize``, takes its
    whole tensors from ``state_dict`` (what a Trainer gathered).
    """
    config = getattr(model, "config", None)
    check_output(output_dir, getattr(config, "_name_or_path", None) or None)
    synchronize = synchronize and torch.distributed.is_available() and torch.distributed.is_initialized()
    # FSDP: every rank takes part in gathering the parameters (with synchronize); the main one writes
    with unwrap_if_fsdp(model, None if synchronize else _whole_state(model, state_dict)):
        if not synchronize or torch.distributed.get_rank() == 0:
            _write(output_dir, model, processor, save_compressed, recipe, parse_size(max_shard_size))
    if synchronize:
        torch.distributed.barrier()  # the others wait for the main process to finish writing
    logger.info("saved %s checkpoint to %s", "compressed" if save_compressed else "dense", output_dir)
    return Path(output_dir)


def _whole_state(model: nn.Module, state_dict: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    if state_dict is None and is_sharded(model):
        raise CheckpointError(
            "a sharded (FSDP) model saved by one rank alone: its parameters cannot be gathered",
            got="synchronize=False without the gathered state_dict",
            expected="every rank calling save_checkpoint (it gathers), or the whole state_dict passed in",
            fix="call save_checkpoint / save_pretrained on every rank",
        )
    return state_dict


def _write(output_dir: str | Path, model: nn.Module, processor: Any, save_compressed: bool, recipe: Recipe | None,
           limit: int) -> None:
    sparsity = sparsity_config_for(model)  # before the held weights go to the state dict, one by one
    names = KeyMap(model)  # the names transformers' save_pretrained would write
    with atomic_directory(output_dir, replaces=is_checkpoint_file) as tmp:
        _write_shards(tmp, model, save_compressed, names, limit)
        _write_config(tmp, model, *_compression_config(model, save_compressed, sparsity, names))
        if processor is not None:
            processor.save_pretrained(str(tmp))
        recorded = recipe if recipe is not None else applied_recipe(model)
        if recorded is not None and recorded.stages:
            (tmp / RECIPE_NAME).write_text(recorded.to_yaml(), encoding="utf-8")
        _copy_remote_code(tmp, model)
        write_record(tmp)


def is_checkpoint_file(name: str) -> bool:
    """Files a save writes or makes stale (old weight shards, an old recipe); everything else in
    the folder is kept."""
    return bool(_WEIGHT_FILE.fullmatch(name)) or name in (RECIPE_NAME, "config.json", "generation_config.json", RECORD_NAME)


def _write_shards(folder: Path, model: nn.Module, save_compressed: bool, names: KeyMap, limit: int) -> None:
    """The model's tensors (``compressed_state_dict``) as sharded safetensors: each module's
    tensors go to the ``ShardedWriter`` as they are made (beyond a few, into its scratch file), so
    the compressed model is never in memory whole, nor, for held layers, its float weights."""
    writer = ShardedWriter(folder, limit)
    try:
        compressed_state_dict(model, save_compressed, emit=lambda key, tensor: writer.add(names.to_checkpoint(key), tensor))
        writer.finish()
    except BaseException:
        writer.abort()
        raise


def _compression_config(model: nn.Module, save_compressed: bool, sparsity: dict[str, Any] | None,
                        names: KeyMap | None = None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``quantization_config`` (None for a model that is not quantized: a plain checkpoint, as
    llm-compressor writes it; transformers + compressed-tensors refuse one without config groups)
    and the sparsity record of pruned modules, which goes under llmpress's own config key. Inside
    ``quantization_config``, ``sparsity_config`` is ``{}`` as compressed-tensors 0.19 writes it:
    sparsity was removed from compressed-tensors, and vLLM 0.32 refuses a checkpoint whose
    ``sparsity_config`` names targets ("Sparsity support has been removed"). The weights are
    dense either way (zeros stored as zeros). ``names``: the checkpoint's names, in which MoE
    routers are listed in ``ignore`` (``quantization_config_for``)."""
    config = quantization_config_for(model, save_compressed, names)
    if config is not None and sparsity is not None:
        config["sparsity_config"] = {}
    return config, sparsity


def _write_config(
    folder: Path, model: nn.Module, quantization_config: dict[str, Any] | None, sparsity: dict[str, Any] | None = None,
) -> None:
    config = getattr(model, "config", None)
    if config is None:
        raise CheckpointError(
            "the model has no config to save",
            got=type(model).__name__,
            expected="a transformers PreTrainedModel (with .config)",
        )
    config = copy.deepcopy(config)
    if hasattr(config, SPARSITY_KEY):
        delattr(config, SPARSITY_KEY)
    if sparsity is not None:
        setattr(config, SPARSITY_KEY, sparsity)
    if quantization_config is not None:
        config.quantization_config = quantization_config
    elif hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantized or never quantized: a plain checkpoint
    config.save_pretrained(str(folder))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and getattr(model, "can_generate", lambda: False)():
        generation_config.save_pretrained(str(folder))


def _copy_remote_code(folder: Path, model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if not getattr(config, "auto_map", None):
        return
    source = _source_folder(getattr(config, "_name_or_path", ""))
    if source is None:
        logger.warning("auto_map model: could not find the source folder of its .py files to copy")
        return
    for path in source.glob("*.py"):
        shutil.copy2(path, folder / path.name)


def _source_folder(name_or_path: str) -> Path | None:
    if name_or_path and Path(name_or_path).is_dir():
        return Path(name_or_path)
    if not name_or_path:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, local_files_only=True, allow_patterns=["*.py"]))
    except Exception:  # not in the local cache: nothing to copy from
        return None
