"""What llmpress keeps on a model while it compresses it, and the hooks that act on it:
quantization schemes and scales on modules with their input fake-quantization (``attach.py``),
quantization-aware training (``qat.py``), the fp8 KV cache (``kv_cache.py``), pruning marks
(``sparsity.py``), and the model's own records (``records.py``: its recipe, its held weights).
The math itself is ``llmpress.quant``'s, pure functions on tensors."""
