"""One registration per quantization method: its config class, its ``Quantizer`` and its
transformers adapter, together.

::

    @register_quantization_method("half", config=HalfConfig)
    class HalfQuantizer(Quantizer):
        ...

After this, ``llmpress.load(path, quantization_config=HalfConfig())`` and a checkpoint whose
``quantization_config`` says ``"quant_method": "half"`` use ``HalfQuantizer``; so does
``transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=HalfConfig())``,
through the generic adapter in ``loading/transformers_quantizer.py``, which follows every
registration (``when_registered``; transformers 5; methods transformers already has,
compressed-tensors among them, keep transformers' own).
Plugins register the same way from a module named in the ``llmpress.quantization_method``
entry-point group. See ``docs/adding-a-quantization-method.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from transformers.utils.quantization_config import QuantizationConfigMixin

from llmpress.errors import CheckpointError, RegistryError
from llmpress.loading.config import QuantizationConfig, QuantizationMethod, method_name
from llmpress.registry import Registry

if TYPE_CHECKING:
    from llmpress.loading.quantizer import Quantizer

__all__ = ["METHODS", "Method", "config_from_dict", "make_quantizer", "register_quantization_method", "when_registered"]


class Method(NamedTuple):
    config: type[QuantizationConfig]
    quantizer: type[Quantizer]


METHODS: Registry[Method] = Registry("quantization method", CheckpointError)
_FOLLOWERS: list[Callable[[str, type[QuantizationConfig]], object]] = []


def when_registered(follow: Callable[[str, type[QuantizationConfig]], object]) -> None:
    """Call ``follow(name, config)`` for every method registered so far and every later one
    (the transformers adapter registers each with transformers this way)."""
    _FOLLOWERS.append(follow)
    for name in METHODS.names():
        follow(name, METHODS.get(name).config)


def register_quantization_method(method: str | QuantizationMethod, *, config: type[QuantizationConfig]
                                 ) -> Callable[[type[Quantizer]], type[Quantizer]]:
    """Class decorator on a ``Quantizer``: it and ``config`` are the method ``method``."""
    name = method_name(method)

    def register(quantizer: type[Quantizer]) -> type[Quantizer]:
        if method_name(config.quant_method) != name:
            raise RegistryError(
                f"{config.__name__}.quant_method must name the method it is registered for",
                got=repr(config.quant_method),
                expected=repr(name),
            )
        METHODS.register(name)(Method(config, quantizer))
        for follow in _FOLLOWERS:
            follow(name, config)
        return quantizer

    return register


def make_quantizer(config: QuantizationConfig, *, pre_quantized: bool) -> Quantizer:
    """The registered quantizer of ``config``'s method, made for ``config``."""
    return METHODS.get(method_name(config.quant_method)).quantizer(config, pre_quantized=pre_quantized)


def config_from_dict(data: dict[str, Any] | QuantizationConfigMixin) -> QuantizationConfig:
    """The registered config of a ``quantization_config`` entry (a dict from ``config.json``)."""
    if isinstance(data, QuantizationConfig):
        return data
    if isinstance(data, QuantizationConfigMixin):
        data = data.to_dict()
    method = data.get("quant_method")
    if method is None:
        raise CheckpointError(
            "the quantization_config has no quant_method", got=str(sorted(data)), expected="a 'quant_method' key"
        )
    return METHODS.get(method_name(method)).config.from_dict(data)
