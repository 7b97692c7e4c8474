"""Adapters to other libraries' training loops: transformers' Trainer (``trainer.py``)."""
