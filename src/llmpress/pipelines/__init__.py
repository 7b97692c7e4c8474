"""How data flows through a model while it is compressed.

Read in this order:

1. ``layerwise.py``: the loop. Capture the first block's inputs, then block after block:
   ``block_start``, calibrate, hold the finished block as integers, hand its outputs on.
2. ``reference.py``: one block, the readable way: observe, compress (``modules_calibrated``,
   ``layer_calibrated``), re-run, hand on. Every faster route is tested against it.
3. ``blocks.py``: how the first block's inputs are captured and a block's outputs handed on
   (what a block *is* to the modifiers: ``llmpress.contract.block``); ``tail.py``: the
   modules after the blocks (a quantized lm_head); ``stand_ins.py``: running a model with some
   modules answered instead of computed.
4. ``by_module/``: the faster module-by-module route (plan, probe, sequential).
5. ``storage/``: where activations wait (memory or spill files), the execution device, finished
   layers held as integers, and the work folder a run resumes from.

``basic.py`` calibrates a model whole; ``data_free.py`` walks the blocks of a recipe that needs
no data (compress, hold); ``training.py`` is the small training loop ``train`` runs.
"""
