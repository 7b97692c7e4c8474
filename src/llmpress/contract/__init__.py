"""What the session, the pipelines and the algorithms agree on, so that algorithms never import
a pipeline: the modifier contract (``modifier.py``: hooks, events, state, the registry), the
observation that hands calibration inputs to modifiers (``observation.py``), and the block a
pipeline hands over (``block.py``)."""
