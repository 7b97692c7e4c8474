"""Where a checkpoint is: a local folder, or a Hub model id resolved to the local cache."""

from __future__ import annotations

from pathlib import Path

from llmpress.errors import CheckpointError

__all__ = ["model_folder"]


def model_folder(path: str | Path) -> Path:
    """A local checkpoint folder, or a Hub model id (``Qwen/Qwen3-8B``) resolved as
    ``from_pretrained`` resolves it: the local cache first, downloading only when online
    (``HF_HUB_OFFLINE=1`` is honoured)."""
    folder = Path(path)
    if (folder / "config.json").is_file():
        return folder
    if not folder.exists() and _is_repo_id(str(path)):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.yaml"]))
        except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
            raise CheckpointError(
                "the model is neither a local folder nor in the Hugging Face cache",
                got=f"{path}: {str(exc).splitlines()[0]}",
                expected="a local checkpoint folder, or a Hub model id that is cached (or reachable online)",
                fix="download it first (huggingface-cli download ID), or unset HF_HUB_OFFLINE",
            ) from None
    raise CheckpointError(
        "not a model checkpoint folder",
        got=str(folder),
        expected="a local folder with config.json and *.safetensors, or a Hub model id",
        fix="check the --model path",
    )


def _is_repo_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") and " " not in p for p in parts)
