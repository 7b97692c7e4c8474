"""Resumable one-shot runs: a work folder beside the output keeps each finished layer.

After each block, layer-by-layer calibration writes to ``<output>.llmpress-work/``:

* ``layer-NNNNN.state.pt``: the block as compressed (weights on their grid as the integers
  ``pipelines/storage/compact.py`` holds them, scales, folded smoothing scales, KV-cache scales);
* ``layer-NNNNN.inputs.rankR.pt``: the next block's inputs on each rank (the block's outputs),
  only once ``INPUTS_EVERY_S`` seconds have gone by since the last ones were written (and only
  the newest are kept): they are the whole calibration set's activations, for an 8B model on
  512 x 2048 tokens 8.6 GB a layer in bf16, while a block's state is its weights;
* ``progress.json``: the run's fingerprint (model, recipe, batches, options, ranks), the layers
  done, after which layer the inputs were last written, each file's SHA-256.

Every file is written to a temporary name and renamed into place, and ``progress.json`` names a
layer only once its files are whole, so a kill at any point leaves the last finished layer
readable. ``oneshot(..., resume=True)`` checks the fingerprint and each file's hash, puts the
finished blocks back (the modifiers hear ``layer_restored``), runs those finished after the last
inputs written on those inputs (one forward each, not calibrated again) and goes on from the next
one: the checkpoint is the one an uninterrupted run writes, bit for bit. When it is written, the
run's fingerprint goes into it (``llmpress_run.json``) and the work folder goes; a run that fails
before its first layer is finished removes it too (nothing to go on from). Resume covers recipes
of one one-shot stage on the layerwise pipeline; a run of several stages starts over.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmpress.checkpoint.atomic import sha256_of, write_file
from llmpress.checkpoint.output import RECORD_NAME
from llmpress.errors import CheckpointError
from llmpress.models.classes import model_dtype
from llmpress.parallel.distributed import gather_objects, is_distributed, is_main_process, rank, world_size
from llmpress.pipelines.storage.compact import HELD, CompactWeights, mapped_state, put_tensor
from llmpress.pipelines.storage.onload import compute_dtype, execution_device
from llmpress.tensorfiles.read import shards_identity
from llmpress.transforms.online import OnlineTransform
from llmpress.version import __version__

__all__ = ["WorkFolder", "run_fingerprint"]

logger = logging.getLogger(__name__)

PROGRESS = "progress.json"
#: the next block's inputs are written after a block once this long has gone by since they were
#: last written: a resumed run then forwards at most this much calibration's worth of blocks
INPUTS_EVERY_S = 300.0


def run_fingerprint(model: nn.Module, recipe: Any, batches: list[torch.Tensor] | None, options: Any, source: Path | None = None) -> str:
    """What makes two runs the same run: the model (config, every tensor's name, shape, dtype, and first and last values,
    or the ``source`` folder's shards it was just read from), recipe, tokens, options, where and in what dtype it calibrates, ranks."""
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    digest.update((config.to_json_string(use_diff=False) if config is not None else type(model).__name__).encode())
    digest.update(shards_identity(source).encode() if source is not None else b"")
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        if tensor.numel() and not tensor.is_meta and source is None:
            flat = tensor.detach().reshape(-1)
            for part in (flat[:1024], flat[-1024:]):  # a few pages: the model stays where it was loaded
                digest.update(part.cpu().float().numpy().tobytes())
    digest.update(json.dumps(recipe.to_dict(), sort_keys=True).encode())  # not its YAML layout
    for batch in batches or []:
        digest.update(batch.cpu().numpy().tobytes())
    digest.update(repr(options).encode())
    # where and in which dtype the layers calibrate, as resolved: a GPU's run resumed on a CPU is another
    device = execution_device(model, getattr(options, "device", None))
    digest.update(f"{device} {compute_dtype(model_dtype(model), device, getattr(options, 'compute_dtype', None))}".encode())
    # each rank's batches are its share: the run is all of them, in rank order
    return hashlib.sha256("".join(gather_objects(digest.hexdigest())).encode()).hexdigest()


class WorkFolder:
    """One run's work folder (see the module docstring)."""

    def __init__(self, output_dir: str | Path, fingerprint: str) -> None:
        output = Path(output_dir).absolute()
        self.path = output.with_name(output.name + ".llmpress-work")
        self.output, self.fingerprint = output, fingerprint
        self.progress: dict[str, Any] = {"fingerprint": fingerprint, "llmpress": __version__, "layers": 0,
                                         "inputs_after": -1, "files": {}}
        self._inputs_written = time.monotonic()

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def open(cls, output_dir: str | Path, fingerprint: str, resume: bool) -> WorkFolder:
        """This run's work folder: what an earlier run of it left (``resume``), else a new one."""
        work = cls(output_dir, fingerprint)
        if resume and work.finished:
            return work
        found = work._read_progress()
        if resume and found is not None:
            if found.get("fingerprint") != fingerprint:
                raise CheckpointError(
                    f"the work folder {work.path} is of another run",
                    got="a different model, recipe, calibration data, options or rank count",
                    expected="the model, recipe, data and options of the interrupted run",
                    fix=f"run without --resume to start over (it replaces {work.path.name}), or give the interrupted run's inputs",
                )
            found.setdefault("inputs_after", found["layers"] - 1)  # a folder of before: inputs after every layer
            work.progress = found
            logger.warning("resuming: %d layer(s) of %s done", found["layers"], work.output)
            return work
        if resume:
            logger.warning("--resume: no work folder of this run at %s: starting from the first layer", work.path)
        if is_main_process() and work.path.exists():
            shutil.rmtree(work.path)
        if is_distributed():
            torch.distributed.barrier()  # nobody writes before the old folder is gone
        work.path.mkdir(parents=True, exist_ok=True)
        return work

    def _read_progress(self) -> dict[str, Any] | None:
        file = self.path / PROGRESS
        if not file.exists():
            return None
        try:
            return json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {file}", got=str(exc), expected="the progress file a run wrote",
                                  fix="run without --resume to start over") from None

    @property
    def finished(self) -> bool:
        """Whether this run already wrote its checkpoint (which records the run's fingerprint)."""
        try:
            return json.loads((self.output / RECORD_NAME).read_text(encoding="utf-8")).get("fingerprint") == self.fingerprint
        except (OSError, ValueError):
            return False

    @property
    def layers_done(self) -> int:
        return int(self.progress["layers"])

    @property
    def inputs_after(self) -> int:
        """The layer whose outputs were last written as the next one's inputs; -1 for none."""
        return int(self.progress["inputs_after"])

    @property
    def notes(self) -> list | None:
        """What the modifiers asked to keep with the last finished layer (``Session.resume_notes``), or None."""
        return self.progress.get("notes")

    # -- writing -----------------------------------------------------------------------------
    def save_layer(self, index: int, block: nn.Module, held: CompactWeights, inputs: list, rest: Any,
                   notes: list | None = None) -> Path | None:
        """Block ``index`` is finished: its state (rank 0) and, when due (``INPUTS_EVERY_S``), the next
        block's inputs (each rank; empty after the last block), ``notes`` (what the modifiers keep across
        a resume, in progress.json). Returns the state file, on every rank once it is whole (``page_out``)."""
        files: dict[str, str] = {}
        state_file = self.path / f"layer-{index:05d}.state.pt"
        if is_main_process():
            files[state_file.name] = write_file(state_file, _block_state(block, held))
        due = gather_objects(time.monotonic() - self._inputs_written >= INPUTS_EVERY_S)[0]  # rank 0's clock decides
        if due:
            name = f"layer-{index:05d}.inputs.rank{rank()}.pt"
            files[name] = write_file(self.path / name, (list(inputs), rest))  # spilled inputs read back
            self._inputs_written = time.monotonic()
        everyone = gather_objects(files)  # every rank's files are whole before progress names them
        if is_main_process():
            for written in everyone:
                self.progress["files"].update(written)
            previous = self.inputs_after
            self.progress["layers"] = index + 1
            self.progress["notes"] = notes
            if due:
                self.progress["inputs_after"] = index
            self._write_progress()
            if due and previous >= 0:  # only the newest inputs are needed to go on
                for r in range(world_size()):
                    stale = self.path / f"layer-{previous:05d}.inputs.rank{r}.pt"
                    self.progress["files"].pop(stale.name, None)
                    stale.unlink(missing_ok=True)
        return state_file if state_file.exists() else None  # (a rank on another machine, without the folder: None)

    def abandon(self) -> None:
        """The run failed: its folder goes if no layer was finished, else it stays for ``--resume``."""
        if is_main_process() and self.layers_done == 0:
            shutil.rmtree(self.path, ignore_errors=True)

    def finish(self) -> None:
        """The checkpoint is written: it records the run, and the work folder goes."""
        if is_distributed():
            torch.distributed.barrier()
        if not is_main_process():
            return
        record = {"fingerprint": self.fingerprint, "llmpress": __version__}
        write_file(self.output / RECORD_NAME, json.dumps(record, indent=1).encode(), durable=True)
        shutil.rmtree(self.path, ignore_errors=True)

    def _write_progress(self) -> None:
        write_file(self.path / PROGRESS, json.dumps(self.progress, indent=1).encode(), durable=True)

    # -- reading -----------------------------------------------------------------------------
    def _load(self, name: str) -> Any:
        return torch.load(self._checked(name), weights_only=True, mmap=True)

    def _checked(self, name: str) -> Path:
        """The work file ``name``, refused unless it is what was written (its SHA-256)."""
        file = self.path / name
        expected = self.progress["files"].get(name)
        if expected is None or not file.exists() or sha256_of(file) != expected:
            raise CheckpointError(
                f"the work folder {self.path} is damaged: {name} is missing or not what was written",
                got="a file that does not match its SHA-256 in progress.json",
                expected="the files of the finished layers, as written",
                fix="run without --resume to start over",
            )
        return file

    def restore_layer(self, index: int, block: nn.Module, held: CompactWeights) -> None:
        """Put block ``index`` back as it was when it finished."""
        integers, rest = mapped_state(self._checked(f"layer-{index:05d}.state.pt"))
        modules = dict(block.named_modules())
        for name, k in integers.items():
            held.adopt(modules[name], k)
        for key, tensor in rest.items():
            path, _, attribute = key.rpartition(".")
            put_tensor(modules[path], attribute, tensor)

    def last_inputs(self) -> tuple[list, Any]:
        """This rank's inputs of the block after ``inputs_after``, and what else that layer returned."""
        return self._load(f"layer-{self.inputs_after:05d}.inputs.rank{rank()}.pt")


def _block_state(block: nn.Module, held: CompactWeights) -> dict[str, torch.Tensor]:
    """Every tensor of ``block``'s state dict, held weights as their integers (key + ``@held``), but for run-time
    rotations: their modifier re-attaches them from its seed in ``on_layer_restored``, after restoring."""
    integers = held.integers_of(block)
    modules = dict(block.named_modules())
    state = {}
    for key, tensor in block.state_dict().items():
        path, _, name = key.rpartition(".")
        module = modules[path]
        if module in integers and name == "weight":
            state[key + HELD] = integers[module]
        elif not tensor.is_meta and not isinstance(module, OnlineTransform):
            state[key] = tensor
    return state
