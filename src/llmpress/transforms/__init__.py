"""Rotations a reader applies at run time: compressed-tensors' ``transform_config``
(``config.py``), the modules that apply them (``online.py``), applying a config to a model
(``apply.py``: QuIP, SpinQuant's R4) and reading one back with a checkpoint (``load.py``)."""
