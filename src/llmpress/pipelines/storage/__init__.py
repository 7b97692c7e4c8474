"""Where a calibration run keeps things: activations between a block's stages and between
blocks (``kept.py``, in memory or spill files), the execution device (``onload.py``), finished
layers held as integers (``compact.py``) and the work folder a run resumes from (``resume.py``)."""
