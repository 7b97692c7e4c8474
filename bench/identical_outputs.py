"""The checkpoints four recipes write on the trained tiny model, as SHA-256 digests per file.

A refactoring that must not change behaviour prints the same digests before and after::

    python bench/identical_outputs.py --work /tmp/before > before.txt   # on the old commit
    python bench/identical_outputs.py --work /tmp/after > after.txt     # on the new one
    diff before.txt after.txt

Recipes: GPTQ W4A16, AWQ W4A16 (+ RTN), SmoothQuant 0.8 + GPTQ W8A8, RTN NVFP4A16; each
calibrated on 32 samples of 256 tokens of the fixture's calibration text, through ``oneshot``
on the checkpoint folder (as the command line runs it). ``llmpress_run.json`` records the run's
fingerprint, which includes the model's path: compare runs that read the fixture from one place
(an old commit's package through ``PYTHONPATH=<old checkout>/src`` with this script).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fixture  # noqa: E402

RECIPES = {
    "gptq_w4a16": "GPTQModifier(scheme='W4A16', ignore=['lm_head'])",
    "awq_w4a16": "[AWQModifier(), QuantizationModifier(scheme='W4A16', ignore=['lm_head'])]",
    "sq_gptq_w8a8": "[SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(scheme='W8A8', ignore=['lm_head'])]",
    "nvfp4a16": "QuantizationModifier(scheme='NVFP4A16', ignore=['lm_head'])",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--only", nargs="*", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--model", type=Path, default=fixture("tiny-llama"),
                        help="the checkpoint (default: the shared fp32 fixture; assets/tiny-llama is a bf16 copy)")
    args = parser.parse_args()
    import llmpress
    from llmpress.data import CalibrationOptions
    from llmpress.modifiers import AWQModifier, GPTQModifier, QuantizationModifier, SmoothQuantModifier  # noqa: F401

    work = args.work or Path(tempfile.mkdtemp(prefix="llmpress-identical-"))
    options = CalibrationOptions(num_samples=32, seq_len=256)
    for name in args.only:
        out = work / name
        llmpress.oneshot(str(args.model), eval(RECIPES[name]), str(fixture('text', 'calibration.txt')),
                         output_dir=out, calibration=options, return_model=False, overwrite=True)
        for file in sorted(p for p in out.iterdir() if p.is_file()):
            print(f"{name}/{file.name} {hashlib.sha256(file.read_bytes()).hexdigest()}")


if __name__ == "__main__":
    main()
