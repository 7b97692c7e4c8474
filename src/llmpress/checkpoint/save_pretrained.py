"""``model.save_pretrained(...)`` through the one save path, for models llmpress touched.

This is the only place that changes a model's ``save_pretrained``. ``route_save_pretrained`` is
called when a session takes a model (``Session.initialize``: one-shot, ``train``, your own loop,
the Trainer integration) and when llmpress loads one (``Quantizer.process_model_after_weight_loading``:
``llmpress.load`` and ``from_pretrained(..., quantization_config=LlmpressConfig(...))``). Every
argument transformers' ``save_pretrained`` accepts is either carried out or refused with an
error that says why; nothing is ignored in silence:

======================  =====================================================================
``is_main_process``     False: this process does not write (transformers' convention); unset,
                        every rank calls and the main one writes
``state_dict``          accepted when it matches the live model (a Trainer passes the gathered
                        one); refused while the live tensors are sharded (FSDP, ZeRO-3)
``max_shard_size``      shard size of the safetensors files
``push_to_hub``         uploads the written folder with huggingface_hub (``repo_id``,
                        ``commit_message``, ``private``, ``create_pr``, ``revision``, ``token``)
``safe_serialization``  True only: llmpress writes safetensors
``variant``             refused: one set of weights per folder
``save_peft_format``    accepted: it concerns PEFT adapters, which these models do not carry
``save_original_format`` True only (the checkpoint's own layout)
``distributed_checkpoint`` False only (a gathered, compressed checkpoint)
``save_compressed``     llmpress's own: False writes the weights dense
======================  =====================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmpress.checkpoint.save import save_checkpoint
from llmpress.errors import CheckpointError
from llmpress.parallel.fsdp import is_dtensor

__all__ = ["route_save_pretrained", "upload_to_hub"]

HUB_ARGUMENTS = ("repo_id", "commit_message", "private", "create_pr", "revision")


def route_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(dir, ...)`` write through :func:`save_checkpoint`."""
    model.save_pretrained = _SavePretrained(model)


class _SavePretrained:
    """``save_pretrained`` of one model, rebuilt for the copy when the model is copied or pickled
    (``torch.save(model)``; a bound method would pickle as a lookup of a name the model lacks).
    It holds the model itself, as a bound method would: ``llmpress.load(a).save_pretrained(b)``
    must keep the model alive while it saves."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, save_directory: str | Path, *args: Any, **kwargs: Any) -> None:
        _save_pretrained(self.model, save_directory, *args, **kwargs)

    def __reduce__(self) -> tuple:
        return (_SavePretrained, (self.model,))


def _save_pretrained(
    model: nn.Module,
    save_directory: str | Path,
    is_main_process: bool | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    push_to_hub: bool = False,
    max_shard_size: int | str = "5GB",
    variant: str | None = None,
    token: str | bool | None = None,
    save_peft_format: bool = True,
    save_original_format: bool = True,
    distributed_checkpoint: bool = False,
    safe_serialization: bool = True,
    save_compressed: bool = True,
    **hub: Any,
) -> None:
    _refuse("variant", variant, None, "llmpress writes one set of weights per folder: save to another folder instead")
    _refuse("safe_serialization", safe_serialization, True, "llmpress writes safetensors only")
    _refuse("save_original_format", save_original_format, True, "llmpress writes the checkpoint's own layout")
    _refuse("distributed_checkpoint", distributed_checkpoint, False,
            "llmpress writes one gathered, compressed checkpoint from the main process")
    unknown = sorted(set(hub) - set(HUB_ARGUMENTS))
    if unknown:
        raise CheckpointError(
            f"save_pretrained got unknown argument(s) {', '.join(map(repr, unknown))}",
            expected=f"transformers' save_pretrained arguments, and with push_to_hub: {', '.join(HUB_ARGUMENTS)}",
        )
    if hub and not push_to_hub:
        raise CheckpointError(f"{', '.join(sorted(hub))} only apply with push_to_hub=True", got=sorted(hub))
    if is_main_process is False:
        return  # transformers' convention: only the main process calls with True, and writes
    _check_given_state_dict(model, state_dict)
    # without is_main_process every rank calls (the main one writes, the others wait for it); a
    # sharded model saved by the main process alone takes its whole tensors from the given state dict
    folder = save_checkpoint(save_directory, model, save_compressed=save_compressed, max_shard_size=max_shard_size,
                             synchronize=is_main_process is None, state_dict=state_dict or None)
    if push_to_hub:
        upload_to_hub(folder, token=token, **hub)


def _refuse(name: str, value: Any, supported: Any, why: str) -> None:
    if value != supported:
        raise CheckpointError(f"save_pretrained cannot honour {name}={value!r}", got=value,
                              expected=repr(supported), fix=why)


def upload_to_hub(folder: Path, *, repo_id: str | None = None, token: str | bool | None = None,
                commit_message: str | None = None, private: bool | None = None, create_pr: bool = False,
                revision: str | None = None) -> str:
    """Upload a saved checkpoint folder to the Hugging Face Hub (the repository is created when
    missing, named after the folder by default). Returns the repository id."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo = api.create_repo(repo_id or Path(folder).name, private=private, exist_ok=True).repo_id
    api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message=commit_message or "Upload compressed model",
                      create_pr=create_pr, revision=revision)
    return repo


def _check_given_state_dict(model: nn.Module, given: dict[str, torch.Tensor] | None) -> None:
    """llmpress saves the live modules (their schemes, masks, QAT state); a state dict handed in
    (a Trainer gathering FSDP shards) gives the whole tensors of a sharded model (``unwrap_if_fsdp``),
    and must otherwise match the live tensors."""
    if not given:
        return
    live = dict(model.named_parameters())  # not state_dict(): under FSDP that is a collective
    wrong = [k for k, v in given.items() if k in live and not is_dtensor(live[k]) and tuple(live[k].shape) != tuple(v.shape)]
    sharded = [n for n, p in live.items() if p.is_meta or hasattr(p, "ds_id") or type(p).__name__ == "FlatParameter"
               or "_fsdp_wrapped_module" in n]
    if wrong or sharded:
        raise CheckpointError(
            "save_pretrained got a gathered state_dict while the model's own tensors are sharded in a way llmpress cannot read",
            got=f"{len(wrong) + len(sharded)} sharded or reshaped tensor(s), e.g. {(wrong or sharded)[:1]}",
            expected="whole tensors, or FSDP2 (fully_shard) DTensors",
            fix="use FSDP2 (fully_shard / fsdp_version 2), or gather the model and call llmpress.save_checkpoint on it",
        )
