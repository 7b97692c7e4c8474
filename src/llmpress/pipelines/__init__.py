"""How data flows through a model while it is compressed.

Read in this order: ``reference.py`` (one block: observe, compress, re-run, hand on), ``blocks.py``
(the blocks, their cached inputs, what a modifier may ask of a block), ``layerwise.py`` (the
driver: block after block), then the faster module-by-module route (``plan.py``,
``sequential.py``, ``kept.py``, ``stand_ins.py``) and the modules after the blocks (``tail.py``).
``basic.py`` calibrates a model whole; ``training.py`` is the session inside a training loop.
"""
