"""A bf16 model calibrated in float32 where bf16 products are slow (lifecycle/compute_dtype.py,
pipelines/storage/onload.py): the layers run in float32, the model and its output keep bf16."""

from __future__ import annotations

import pytest
import torch
from helpers import checkpoint_tensors, make_tiny_llama, token_batches

import llmpress
from llmpress import native
from llmpress.data import CalibrationOptions
from llmpress.errors import DataError
from llmpress.lifecycle.compute_dtype import computing_in, stored_dtype
from llmpress.pipelines.storage import onload
from llmpress.pipelines.storage.onload import OnDevice, compute_dtype

CPU = torch.device("cpu")
# left to right: in activation order, a Hessian diagonal that moves in its last bits reorders columns
GPTQ = """
quant_stage:
  quant_modifiers:
    GPTQModifier: {targets: [Linear], ignore: [lm_head], scheme: W4A16, actorder: null}
"""


def test_the_compute_dtype_is_float32_only_where_bf16_products_are_emulated(monkeypatch):
    monkeypatch.setattr(native, "bf16_native", lambda: False)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset())
    assert compute_dtype(torch.bfloat16, CPU) == torch.float32
    assert compute_dtype(torch.float16, CPU) == torch.float32
    assert compute_dtype(torch.float32, CPU) is None
    assert compute_dtype(torch.bfloat16, torch.device("cuda", 0)) is None  # a GPU multiplies bf16 itself
    assert compute_dtype(torch.bfloat16, CPU, "bfloat16") is None  # asked for: its own
    monkeypatch.setattr(native, "bf16_native", lambda: True)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"amx_fp16"}))
    assert compute_dtype(torch.bfloat16, CPU) is None and compute_dtype(torch.float16, CPU) is None
    assert compute_dtype(torch.bfloat16, CPU, "float32") == torch.float32
    assert compute_dtype(torch.float32, CPU, "bfloat16") == torch.bfloat16
    with pytest.raises(DataError, match="unknown compute dtype"):
        CalibrationOptions(compute_dtype="int8")


def test_a_block_computes_in_float32_and_goes_back_to_its_own_values():
    model = make_tiny_llama().to(torch.bfloat16)
    layer = model.model.layers[0]
    before = {n: t.clone() for n, t in layer.state_dict().items()}
    params = {n: p for n, p in layer.named_parameters()}
    layer.register_buffer("rotary_like", torch.arange(4.0))  # a float32 buffer stays as it is
    with computing_in(layer, torch.float32):
        assert {p.dtype for p in layer.parameters()} == {torch.float32}
        assert stored_dtype(layer.self_attn.q_proj) == torch.bfloat16
        layer.mlp.down_proj.weight.data = layer.mlp.down_proj.weight.data * 2  # a modifier's result, in float32
    assert stored_dtype(layer.self_attn.q_proj) == torch.bfloat16  # its own again
    assert all(p is params[n] for n, p in layer.named_parameters())  # the same objects
    assert layer.rotary_like.dtype == torch.float32
    for name, tensor in layer.state_dict().items():
        if name == "rotary_like":
            continue
        assert tensor.dtype == torch.bfloat16, name
        expected = before[name] * 2 if name == "mlp.down_proj.weight" else before[name]
        assert torch.equal(tensor, expected), name


def test_inputs_are_read_in_the_compute_dtype_and_kept_in_the_stored_one():
    rotary = (torch.randn(6, 4, dtype=torch.bfloat16), torch.randn(6, 4, dtype=torch.bfloat16))
    mask = torch.ones(1, 6, dtype=torch.long)
    items = [((torch.randn(1, 6, 8, dtype=torch.bfloat16),), {"position_embeddings": rotary, "mask": mask}) for _ in range(2)]
    seen = OnDevice(list(items), CPU, CPU, torch.float32, torch.bfloat16)
    (hidden,), kwargs = seen[0]
    assert hidden.dtype == torch.float32 and torch.equal(hidden, items[0][0][0].float())
    assert kwargs["position_embeddings"][0].dtype == torch.float32 and kwargs["mask"] is mask
    assert seen[1][1]["position_embeddings"][0] is kwargs["position_embeddings"][0]  # shared: cast once
    seen[0] = ((hidden * 3,), kwargs)
    (back,), back_kwargs = seen.inner[0]
    assert back.dtype == torch.bfloat16 and back_kwargs["position_embeddings"][0] is rotary[0]


def test_a_bf16_model_calibrated_in_float32_saves_what_a_bf16_run_saves(tmp_path, monkeypatch, caplog):
    batches = token_batches(count=4, length=32)
    seen: dict[str, set] = {}
    runs = {}
    for name, requested in (("bf16", "bfloat16"), ("float32", None)):
        monkeypatch.setattr(native, "bf16_native", lambda: False)  # auto: float32
        model = make_tiny_llama().to(torch.bfloat16)
        seen[name] = set()
        q_proj = model.model.layers[1].self_attn.q_proj
        q_proj.register_forward_pre_hook(lambda m, args, s=seen[name]: s.add((args[0].dtype, m.weight.dtype)))
        with caplog.at_level("INFO", logger="llmpress.pipelines.layerwise"):
            llmpress.oneshot(model, GPTQ, batches, output_dir=tmp_path / name, calibration=CalibrationOptions(compute_dtype=requested))
        runs[name] = checkpoint_tensors(tmp_path / name)
        assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.bfloat16}
    assert seen == {"bf16": {(torch.bfloat16, torch.bfloat16)}, "float32": {(torch.float32, torch.float32)}}
    assert "calibrating each layer in float32 (this CPU has no bf16 / fp16 matrix units" in caplog.text
    bf16, f32 = runs["bf16"], runs["float32"]
    assert {n: (t.dtype, t.shape) for n, t in bf16.items()} == {n: (t.dtype, t.shape) for n, t in f32.items()}
    assert f32["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16
    # the first layer's q/k/v see the same bf16 embeddings: the same Hessian up to the sums'
    # rounding, so nearly the same integers; later modules follow the float32 forwards
    def agree(name: str) -> float:
        return (bf16[name] == f32[name]).float().mean().item()

    first = "model.layers.0.self_attn.q_proj.weight_packed"
    later = [n for n in f32 if n.endswith("weight_packed") and n != first]
    print({n: round(agree(n), 3) for n in [first, *later]})
    assert agree(first) > 0.9
    assert min(agree(n) for n in later) < agree(first)


def test_a_resumed_run_on_a_cpu_of_another_kind_is_another_run(monkeypatch):
    from llmpress.pipelines.storage import resume

    model, recipe = make_tiny_llama().to(torch.bfloat16), llmpress.Recipe.from_any(GPTQ)
    batches = [torch.arange(16).reshape(1, 16)]
    monkeypatch.setattr(onload.native, "bf16_native", lambda: True)
    here = resume.run_fingerprint(model, recipe, batches, CalibrationOptions())
    monkeypatch.setattr(onload.native, "bf16_native", lambda: False)
    assert resume.run_fingerprint(model, recipe, batches, CalibrationOptions()) != here
