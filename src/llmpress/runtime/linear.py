"""``QuantizedLinear``: a linear layer whose weight stays quantized in memory.

It takes one module's compressed-tensors tensors (any format) and keeps them in the layout of the
fastest kernel that applies:

- ``int4``: 4-bit integer weights in groups of 32..256 → llmpress's own operator
  (``llmpress/native``: an integer product at memory speed for decode; for prefill, dequantized
  rows and a product in the input's dtype, bf16 on AMX tiles where the CPU has them), or
  PyTorch's ``_weight_int4pack_mm_for_cpu`` where it does not build. A grid the kernel does
  not take as it is goes in smaller groups where that is exact (``kernels.int4_group``): groups
  of 128 over 576 columns as groups of 64, per-channel scales repeated per group;
- ``int8``: 8-bit integer per-channel (or per-tensor) weights, in whole 16-column blocks →
  llmpress's integer product for decode (``native.int8_linear``, columns in whole 32s; PyTorch's
  ``_weight_int8pack_mm`` elsewhere); prefill as bf16 products (``native.int8_linear_bf16``)
  where the CPU has native bf16;
- ``int8x8``: the same weights with 8-bit integer input activations (W8A8): from
  ``int8_inputs.MIN_ROWS`` tokens on, an int8 × int8 product on oneDNN (exact integers, see
  ``int8_inputs``); fewer tokens (decode) run as ``int8`` on the fake-quantized input;
- ``bf16``: microscaling and block formats (NVFP4, MXFP4, FP8 block: no CPU kernel takes fp4
  values or 16-column groups), and integer grids no integer kernel takes (widths that are not
  whole 64-column blocks, groups that no kernel group divides exactly, grouped int8), keep the
  stored tensors and, from the first forward, their weight dequantized once in bf16 (2 bytes a
  weight): few-token inputs (decode) multiply in bf16, at dense bf16's speed; longer ones
  (prefill) in the input's dtype;
- ``dequant``: anything else (fp8 per channel or tensor, Conv1D's layout) keeps the stored
  tensors and decompresses them on the fly for each forward.

``input_major`` modules stand for transformers' ``Conv1D`` (GPT-2): their tensors are stored
``[in, out]``, with qparams along the output features of each input feature, which no CPU kernel
takes yet; they run on ``dequant``.

Kernels compute in bf16; the result matches the dequantized fp32 reference within the bf16
rounding of activations and scales (relative L2 error about 3e-3 per layer, tested). The buffers
are in the runtime layout (``state_dict()`` shows it, and transformers' loader leaves persistent
buffers alone); ``compressed_state()`` gives the compressed-tensors tensors back for the one save
path, and ``dequantized_weight()`` the dense weight.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from llmpress.compat import own_buffers
from llmpress.formats import FORMATS, format_for
from llmpress.formats.pack_quantized import PACKED_ZERO_POINT_STRATEGIES
from llmpress.lifecycle.attach import fake_quantize_module_input
from llmpress.lifecycle.state import Status, scheme_of, state_of
from llmpress.models.linear import features, input_major
from llmpress.quant.packing import bytewise, unpack_from_int32
from llmpress.quant.qdq import dequantize
from llmpress.quant.scheme import QuantizationScheme, QuantizationStrategy
from llmpress.runtime import int8_inputs, kernels

__all__ = ["QuantizedLinear"]

_INPUT_TENSORS = ("input_scale", "input_zero_point", "input_global_scale")
_INT8 = ("int8", "int8x8")
_STORED = ("dequant", "bf16")  # kernels that keep the stored tensors as they are


class QuantizedLinear(nn.Module):
    #: (FusedProduct, index) while fused with layers reading the same input (fusion.py); a class
    #: default, so modules pickled before fusion existed read None too
    _fusion: tuple | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantizationScheme,
        *,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        input_major: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.input_major = input_major
        state = state_of(self)  # the scheme lives in the module's state, as on every quantized module
        state.scheme, state.status = scheme, Status.COMPRESSED
        self.format = format_for(scheme)
        self.kernel = "empty"
        self.int4_group: int | None = None  # the kernel's group size (may be smaller than the scheme's)
        self._int8_inputs: int8_inputs.Int8Inputs | None = None  # packed on the first long input
        self._dense: torch.Tensor | None = None  # kernel bf16: the weight, dequantized on the first forward
        self._divisor: torch.Tensor | None = None  # and NVFP4's global scale, which divides its products
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    @property
    def scheme(self) -> QuantizationScheme:
        """The scheme its tensors are compressed by (from its state)."""
        return scheme_of(self)

    @classmethod
    def like(cls, linear: nn.Module, scheme: QuantizationScheme) -> QuantizedLinear:
        """An empty module with ``linear``'s shape and layout (``nn.Linear`` or ``Conv1D``; on
        its device: ``meta`` while loading)."""
        n_in, n_out = features(linear)
        return cls(
            n_in, n_out, scheme, bias=linear.bias is not None, dtype=linear.weight.dtype,
            device=linear.weight.device, input_major=input_major(linear),
        )

    def extra_repr(self) -> str:
        w = self.scheme.weights
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weights={w.type}{w.num_bits}/{w.strategy}, kernel={self.kernel}" + (", input_major" if self.input_major else "")
        )

    # -- loading -----------------------------------------------------------------------------
    def load_compressed(self, state: dict[str, torch.Tensor], fmt: str | None = None) -> None:
        """Take this module's stored tensors (local names, in format ``fmt``) and keep them in the
        runtime layout. ``bias`` (when present) is taken too."""
        state = dict(state)
        fmt = fmt or self.format
        if "bias" in state:
            self.bias = nn.Parameter(state.pop("bias"), requires_grad=False)
        for name in _INPUT_TENSORS:
            if name in state:
                self.register_buffer(name, state.pop(name))
        kernel = self.choose_kernel(fmt)
        if kernel in _STORED:
            self._dense = None
            self.format = fmt
            for name, value in state.items():
                self.register_buffer(name, value)
            self.kernel = kernel
            return
        if kernel == "int4" and fmt == "pack-quantized" and bytewise(4, self.in_features):
            scale, zero_point = state["weight_scale"], state.get("weight_zero_point")
            if zero_point is not None and self.scheme.weights.strategy in PACKED_ZERO_POINT_STRATEGIES:
                # packed along the output dimension (a per-tensor zero point is stored as it is)
                zero_point = unpack_from_int32(zero_point, 4, (self.out_features, scale.shape[-1]), dim=0)
            self._set_int4(*kernels.int4_pack_words(state["weight_packed"], *self._kernel_qparams(scale, zero_point)), scale, zero_point)
            return
        unpacked = FORMATS.get(fmt).unpack(state, self.scheme)
        self._load_values(kernel, unpacked["weight"], unpacked["weight_scale"], unpacked.get("weight_zero_point"))

    def load_quantized(self, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> None:
        """Take integer values ``q`` ``[out, in]`` (int8) with their scale / zero point, as a
        quantizer produces them: no packing round trip when a kernel applies."""
        kernel = self.choose_kernel(self.format)
        if kernel not in _STORED:
            self._load_values(kernel, q, scale, zero_point)
            return
        args = self.scheme.weights
        state = {"weight": dequantize(q, scale, zero_point, args, torch.float32), "weight_scale": scale}
        if zero_point is not None:
            state["weight_zero_point"] = zero_point
        self.load_compressed(FORMATS.get(self.format).compress(state, self.scheme))

    def _kernel_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale and zero point per kernel group (the stored ones stay as they are, for saving)."""
        group = self.scheme.weights.group_size

        def spread(qparam: torch.Tensor) -> torch.Tensor:
            return kernels.int4_qparams(qparam, group, self.int4_group, self.out_features, self.in_features)

        return spread(scale), None if zero_point is None else spread(zero_point)

    def _set_int4(self, packed: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> None:
        if self._fusion is not None:  # new values: the fused copy is stale
            self._fusion[0].dissolve()
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero_point", zero_point)
        self.register_buffer("int4_weight", packed)
        self.register_buffer("int4_table", table)
        self.kernel = "int4"

    def _load_values(self, kernel: str, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> None:
        if kernel == "int4":
            self._set_int4(*kernels.int4_pack(q, *self._kernel_qparams(scale, zero_point)), scale, zero_point)
            return
        self._int8_inputs = None  # packed again from these values when needed
        # the scale (and zero point) as stored, for an exact compressed_state()
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero_point", zero_point)
        if kernel in _INT8:
            rows = q.shape[0]
            scale_rows = scale.to(torch.float32).reshape(-1).expand(rows) if scale.numel() == 1 else scale.reshape(rows)
            self.register_buffer("int8_weight", kernels.aligned(q))
            self.register_buffer("int8_scale", scale_rows.to(torch.float32).contiguous())
            correction = None
            if zero_point is not None:
                zp = zero_point.to(torch.float32).reshape(-1).expand(rows) if zero_point.numel() == 1 else zero_point.reshape(rows)
                correction = (zp.float() * scale_rows.float()).contiguous()
            self.register_buffer("int8_zero_correction", correction)
        self.kernel = kernel

    def choose_kernel(self, fmt: str) -> str:
        """The kernel for this module's scheme (and, for ``int4``, ``self.int4_group``)."""
        args = self.scheme.weights
        if (args.is_fp4 or args.strategy == QuantizationStrategy.BLOCK) and not self.input_major:
            return "bf16"
        if args.is_float or self.input_major:  # any format's unpack() gives integer schemes their integers
            return "dequant"
        if args.num_bits == 4 and args.strategy != QuantizationStrategy.TOKEN:
            self.int4_group = kernels.int4_group(self.out_features, self.in_features, args.strategy, args.group_size)
            if self.int4_group is not None:
                return "int4"
        if args.num_bits == 8 and args.strategy in (QuantizationStrategy.CHANNEL, QuantizationStrategy.TENSOR):
            if kernels.int8_supported(self.in_features):
                inputs = self.scheme.input_activations
                return "int8x8" if int8_inputs.int8_inputs_supported(args, inputs) else "int8"
        return "bf16"  # an integer grid no integer kernel takes: dense bf16's speed, not a dequantization per call

    # -- what the module means ---------------------------------------------------------------
    def quantized_values(self) -> torch.Tensor:
        """The integer weight ``[out, in]`` (int8 holding ``num_bits`` values)."""
        if self.kernel == "int4":
            return kernels.int4_unpack(self.int4_weight, self.int4_group, self.int4_table, self.in_features)
        if self.kernel in _INT8:
            return self.int8_weight
        raise RuntimeError(f"QuantizedLinear.quantized_values() needs an integer kernel, not {self.kernel!r}")

    def _stored(self) -> dict[str, torch.Tensor]:
        names = [n for n, _ in self.named_buffers(recurse=False) if n not in _INPUT_TENSORS]
        return {n: getattr(self, n) for n in names}

    def compressed_state(self) -> dict[str, torch.Tensor]:
        """This module's tensors as compressed-tensors stores them (local names), bias included."""
        if self.kernel == "empty":
            raise RuntimeError("QuantizedLinear has no weight yet: call load_compressed() first")
        if self.kernel in _STORED:
            state = self._stored()
        else:  # through the format's own codec, from the exact on-grid weight
            dense = {"weight": self.dequantized_weight(torch.float32), "weight_scale": self.weight_scale}
            if self.weight_zero_point is not None:
                dense["weight_zero_point"] = self.weight_zero_point
            state = FORMATS.get(self.format).compress(dense, self.scheme)
        for name in _INPUT_TENSORS:
            if getattr(self, name, None) is not None:
                state[name] = getattr(self, name)
        if self.bias is not None:
            state["bias"] = self.bias.detach()
        return state

    @property
    def default_dtype(self) -> torch.dtype:
        """The dtype of the dense weight when none is asked for: the bias's, else fp32."""
        return self.bias.dtype if self.bias is not None else torch.float32

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.default_dtype
        if self.kernel in _STORED:
            return FORMATS.get(self.format).decompress(self._stored(), self.scheme, dtype)["weight"]
        args = self.scheme.weights
        return dequantize(self.quantized_values(), self.weight_scale, self.weight_zero_point, args, dtype)

    # -- running -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = self.scheme.input_activations
        if self.kernel == "int8x8" and x.is_cpu and x.numel() >= int8_inputs.MIN_ROWS * self.in_features and not x.requires_grad:
            return self._int8_product(x, inputs)
        if inputs is not None:
            x = fake_quantize_module_input(self, x, inputs)
        if self.kernel == "int4":
            if self._fusion is not None:
                out = self._fusion[0].output(self._fusion[1], x)
            else:
                out = kernels.int4_matmul(x, self.int4_weight, self.int4_group, self.int4_table)
        elif self.kernel in _INT8:
            out = kernels.int8_matmul(x, self.int8_weight, self.int8_scale, self.int8_zero_correction)
        elif self.kernel == "bf16":
            out = self._bf16_product(x)
        elif self.kernel == "dequant":
            weight = self.dequantized_weight(x.dtype)
            out = F.linear(x, weight.t() if self.input_major else weight)
        else:
            raise RuntimeError("QuantizedLinear has no weight yet: call load_compressed() first")
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def _bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times the weight of a microscaling or block format. fp4 weights are held as
        ``q * group scale`` in bf16, which is exact (a 2-bit value times an fp8 scale, or a
        power of two), and NVFP4's global scale divides the product: prefill multiplies them in
        ``x``'s dtype, exactly as the dense view; decode in bf16, at half of fp32's bytes. FP8
        block weights and integer grids in bf16 are not exact: prefill dequantizes them for the
        call."""
        args = self.scheme.weights
        integers = not (args.is_fp4 or args.strategy == QuantizationStrategy.BLOCK)
        if self._dense is None and integers:
            self._dense, self._divisor = self.dequantized_weight(torch.float32).to(kernels.COMPUTE_DTYPE), None
        elif self._dense is None:  # once, from the stored tensors (which stay, for saving)
            unpacked = FORMATS.get(self.format).unpack(self._stored(), self.scheme)
            divisor = unpacked.get("weight_global_scale") if args.has_global_scale else None
            ones = None if divisor is None else torch.ones_like(divisor)
            self._dense = dequantize(unpacked["weight"], unpacked["weight_scale"], None, args, kernels.COMPUTE_DTYPE, ones)
            self._divisor = divisor
        # products of q * group scale are global-scale times too large: they run in a dtype with
        # fp32's range (never fp16) and are divided before going back to x's dtype
        wide = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        if x.numel() < int8_inputs.MIN_ROWS * self.in_features or (integers and x.dtype == self._dense.dtype):
            out = F.linear(x.to(self._dense.dtype), self._dense)  # decode, or the prefill of an integer grid in a bf16 model
        elif args.is_fp4:
            out = F.linear(x.to(wide), self._dense.to(wide))
        else:
            return F.linear(x, self.dequantized_weight(x.dtype))
        if self._divisor is not None:
            out = out.to(wide).div_(self._divisor.to(wide))
        return out.to(x.dtype)

    def _apply(self, fn, recurse=True):  # .to(), .float(): oneDNN's packed copy (the bf16 weight) is rebuilt from the buffers
        self._int8_inputs = self._dense = None
        stored = {name: buffer for name, buffer in own_buffers(self).items() if buffer is not None}
        result = super()._apply(fn, recurse)
        for name, before in stored.items():
            # a dtype cast (model.to(torch.bfloat16), .half()) would round the stored scales (a
            # later save would write other numbers) and the int4 kernel's table (whose dtype also
            # says which layout the weight is in): they keep their dtypes, on the new device
            if own_buffers(self)[name].dtype != before.dtype:
                own_buffers(self)[name] = before.to(own_buffers(self)[name].device)
        if self._fusion is not None and any(own_buffers(self)[n] is not stored[n] for n in ("int4_weight", "int4_table")):
            self._fusion[0].dissolve()  # moved: the fused tensors stayed where they were, every member runs alone
        return result

    def __getstate__(self):  # deepcopy, pickle: oneDNN's packed weight has no storage to copy
        return {**self.__dict__, "_int8_inputs": None, "_dense": None, "_fusion": None}

    def _int8_product(self, x: torch.Tensor, inputs) -> torch.Tensor:
        if self._int8_inputs is None:
            self._int8_inputs = int8_inputs.Int8Inputs(self.int8_weight, self.weight_scale, inputs)
        flat = x.reshape(-1, x.shape[-1])
        out = self._int8_inputs.matmul(flat, getattr(self, "input_scale", None), getattr(self, "input_zero_point", None))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def runtime_bytes(self) -> int:
        """Bytes held by this module's tensors (for reports), oneDNN's packed weight and the bf16
        kernel's weight included."""
        packed = self._int8_inputs.nbytes() if self._int8_inputs is not None else 0
        if self._dense is not None:
            packed += self._dense.numel() * self._dense.element_size()
        return packed + sum(t.numel() * t.element_size() for t in self.buffers(recurse=False)) + (
            self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        )
