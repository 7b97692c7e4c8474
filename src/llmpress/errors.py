"""The one error hierarchy of llmpress.

Every error says what was wrong, what was got, what was expected and how to fix it, so a user
never has to read a traceback from deep inside torch to know what to do next.
"""

from __future__ import annotations

import errno
import re

__all__ = [
    "os_failure",
    "LlmpressError",
    "RecipeError",
    "SessionError",
    "MissingStateError",
    "CheckpointError",
    "UnsupportedModelError",
    "MissingDependencyError",
    "DataError",
    "SchemeError",
    "RegistryError",
]


class LlmpressError(Exception):
    """Base of every error llmpress raises on purpose.

    Build it from parts (``what``, ``got``, ``expected``, ``fix``); ``str()`` joins them into one
    readable sentence. The parts stay available as attributes for programs that react to them.
    """

    def __init__(
        self,
        what: str,
        *,
        got: object | None = None,
        expected: object | None = None,
        fix: str | None = None,
    ) -> None:
        self.what = what
        self.got = got
        self.expected = expected
        self.fix = fix
        super().__init__(self._compose())

    def _compose(self) -> str:
        text = self.what.rstrip(".")
        details = []
        if self.got is not None:
            details.append(f"got {self.got}")
        if self.expected is not None:
            details.append(f"expected {self.expected}")
        if details:
            text += f" ({'; '.join(details)})"
        text += "."
        if self.fix:
            fix = self.fix.strip()
            text += f" Fix: {fix}" + ("" if fix.endswith(("?", "!", ".")) else ".")
        return text


class RecipeError(LlmpressError):
    """A recipe could not be read: unknown modifier, unknown field, bad value, bad grammar."""


class SchemeError(RecipeError):
    """A quantization scheme is invalid (bits, strategy, group size...)."""


class SessionError(LlmpressError):
    """A session call came out of order (an event before initialize, anything after finalize)."""


class MissingStateError(SessionError):
    """A modifier needs a piece of state that nobody supplied before ``initialize()``."""


class CheckpointError(LlmpressError):
    """A checkpoint could not be written or read."""


class UnsupportedModelError(LlmpressError):
    """The model lacks something llmpress needs (no matching layers, unknown architecture)."""


class MissingDependencyError(LlmpressError):
    """An optional package is needed for this feature; the message says what to install."""


class DataError(LlmpressError):
    """Calibration or evaluation data is missing, malformed or too short."""


class RegistryError(LlmpressError):
    """A name is unknown to a registry, or registered twice."""


#: what an operating system's refusal means to the user, by errno, and what to do
_OS_REASONS = {
    errno.ENOSPC: ("the disk is full", "free space on it, or write to another disk"),
    errno.EDQUOT: ("the disk quota is used up", "free space in your quota, or write elsewhere"),
    errno.EFBIG: ("a file grew past what this system or its limits allow", "write to another filesystem, or raise the file size limit (ulimit -f)"),
    errno.EROFS: ("the filesystem is read-only", "write to a writable folder"),
    errno.EACCES: ("permission denied", "write to a folder you own, or fix its permissions"),
    errno.EPERM: ("the operation is not permitted", "write to a folder you own, or fix its permissions"),
    errno.EIO: ("the disk reported an input/output error", "check the disk (dmesg), then run again"),
}


def os_failure(exc: BaseException, doing: str) -> CheckpointError:
    """An operating system's refusal while ``doing`` something, as a CheckpointError that names
    it (disk full, read-only, permission) and the file. Also reads the ``(os error N)`` that
    Rust libraries (tokenizers, safetensors) put in their messages. Raise it ``from exc``."""
    code = getattr(exc, "errno", None)
    if code is None:
        found = re.search(r"os error (\d+)", str(exc))
        code = int(found.group(1)) if found else None
    what, fix = _OS_REASONS.get(code, ("the system refused a file operation", "check free space and permissions"))
    where = getattr(exc, "filename", None)
    detail = getattr(exc, "strerror", None) or str(exc)
    return CheckpointError(f"{doing}: {what}", got=f"{detail}{f' ({where})' if where else ''}", fix=fix)
