"""safetensors files on disk: read one tensor at a time (``read.py``), written one tensor at a
time (``write.py``). Torch and the standard library only, so a path that reads and writes
checkpoints without a model class does not pay for transformers' imports."""
