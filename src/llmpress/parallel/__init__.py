"""Several processes at once: torch.distributed ranks (``distributed.py``: the helpers every
floor above calls, each a no-op in one process) and FSDP-sharded parameters (``fsdp.py``)."""
