"""What llmpress keeps on a model while it compresses it, and what changes it: one
``ModuleState`` per module (``state.py``: scheme, status, sparsity, hooks) and one ``ModelRecord``
per model (``records.py``: its recipe, held weights); schemes and scales with the input
fake-quantization hook (``attach.py``), quantization-aware training as a swap of the module's
class (``qat.py``), the fp8 KV cache (``kv_cache.py``), pruning marks (``sparsity.py``). The math
itself is ``llmpress.quant``'s, pure functions on tensors."""
