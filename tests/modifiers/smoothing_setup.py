"""What the smoothing tests share (SmoothQuant's and AWQ's): the trained tiny model with planted
activation outliers and a block's captured inputs (the calibration and held-out tokens: conftest.py)."""

from __future__ import annotations

import torch
from helpers import trained_model_dir

from llmpress.contract.block import CalibrationBlock


def first_block(model, layers, batches):
    """A CalibrationBlock for ``layers[0]`` with the inputs the model gives it."""
    inputs = []
    handle = layers[0].register_forward_pre_hook(lambda m, a, k: inputs.append((a, k)), with_kwargs=True)
    with torch.no_grad():
        for batch in batches:
            model(torch.tensor([batch]), use_cache=False)
    handle.remove()
    return CalibrationBlock(0, layers[0], inputs)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def add_outliers(pairs, channels=(3, 17, 40), offset=0.0):
    """Activation outliers with the function kept: for each ``(norm, readers)``, ``channels`` of
    the norm's gain ``offset + weight`` (and its bias) x50, and the same input channels of the
    readers /50 (a Linear's columns, a Conv1D's rows)."""
    from llmpress.models.linear import input_major

    with torch.no_grad():
        for norm, readers in pairs:
            for channel in channels:
                norm.weight[channel] = (offset + norm.weight[channel]) * 50 - offset
                if getattr(norm, "bias", None) is not None:
                    norm.bias[channel] *= 50
                for reader in readers:
                    (reader.weight[channel, :] if input_major(reader) else reader.weight[:, channel]).div_(50)


def outlier_model():
    """The trained tiny model with activation outliers: a few channels of each norm ×50 and the
    Linears reading them ÷50 (the same function, as in models with massive activations)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(trained_model_dir()), dtype=torch.float32).eval()
    add_outliers([pair for layer in model.model.layers for pair in (
        (layer.input_layernorm, [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
        (layer.post_attention_layernorm, [layer.mlp.gate_proj, layer.mlp.up_proj]))], channels=(3, 17, 40, 77))
    return model
