"""The one error hierarchy of llmpress.

Every error says what was wrong, what was got, what was expected and how to fix it, so a user
never has to read a traceback from deep inside torch to know what to do next.
"""

from __future__ import annotations

__all__ = [
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
