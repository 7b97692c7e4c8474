"""Calibration on two ranks against one process: time, summed proportional memory, the same checkpoint.

    python bench/ranks.py [--runs 1] [--work DIR]

GPTQ W4A16 (groups of 128, ``lm_head`` dense) on the random 1024-hidden Llama of ``bench/gptq.py`` (``--hidden 2048``: a 1.6 GB one)
(fp32, 8 layers) and its 64 x 256 calibration tokens, by the ``llmpress oneshot`` command: one
process of one thread, then two ranks of one thread each (``OMP_NUM_THREADS=1``): forked from
one process (``--ranks 2``: the ranks share its imported libraries), and under ``torchrun
--nproc-per-node 2`` (two interpreters). Sampled every 0.05 s: the proportional set size (PSS, from
``/proc/PID/smaps_rollup``: a page shared by two processes counts half in each) of the compressing
processes summed, and its peak; then the two checkpoints compared tensor by tensor. Each is
run twice a round: timed with nothing else running, then sampled (the sampler takes a core's
time, which one process leaves free and two ranks on this 2-core machine do not: their wall time
under sampling is shown beside, not used).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
from common import REPO, fixture, save_random_llama, work_folder
from gptq import calibration_tokens, compile_sources, gptq_recipe, make_random_llama

#: the peaks are spikes of a tenth of a second (GPTQ's solves, each layer's end): sampled every
#: 0.2 s, a run's peak read 40-60 MB low or not, so the ratio of two runs moved by +-0.04
SAMPLE_S = 0.05


def _workers(launcher: psutil.Process, torchrun: bool) -> list[psutil.Process]:
    """The processes that compress: torchrun's children, or the process itself and the ranks it forked."""
    try:
        children = launcher.children(recursive=True)
        return [p for p in children if "llmpress" in " ".join(p.cmdline())] if torchrun else [launcher, *children]
    except psutil.Error:
        return []


def run(command: list[str], torchrun: bool = False, sample: bool = True) -> dict:
    """One compression: wall seconds, and (``sample``) the peak of the workers' summed PSS and of
    their summed RSS (MB)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    launcher = psutil.Process(process.pid)
    peak_pss = peak_rss = 0.0
    while sample and process.poll() is None:
        pss = rss = 0
        for worker in _workers(launcher, torchrun):
            try:
                info = worker.memory_full_info()
            except psutil.Error:
                continue
            pss, rss = pss + info.pss, rss + info.rss
        peak_pss, peak_rss = max(peak_pss, pss / 2**20), max(peak_rss, rss / 2**20)
        time.sleep(SAMPLE_S)
    out, err = process.communicate()
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{err[-3000:]}")
    return {"wall_s": wall, "pss_mb": peak_pss, "rss_mb": peak_rss} if sample else {"wall_s": wall}


def same_checkpoint(one: Path, two: Path) -> tuple[int, int]:
    """(tensors equal bit for bit, tensors) between two checkpoints."""
    import torch
    from safetensors.torch import load_file

    a = {k: v for f in sorted(one.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted(two.glob("*.safetensors")) for k, v in load_file(f).items()}
    if a.keys() != b.keys():
        return 0, max(len(a), len(b))
    return sum(torch.equal(a[k], b[k]) for k in a), len(a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="pairs of runs (medians are reported)")
    parser.add_argument("--work", default=None, help="folder for the model and checkpoints (default: a temporary folder)")
    parser.add_argument("--hidden", type=int, default=1024, choices=[1024, 2048],
                        help="the random Llama's width: 1024 (bench/gptq.py's, 0.4 GB) or 2048 (MLP 5632, 32/8 heads, 1.6 GB)")
    args = parser.parse_args()
    work = work_folder(args.work, "llmpress-ranks-")
    compile_sources()
    if args.hidden == 1024:
        model = make_random_llama(work / "random-1024", fixture("tiny-llama"))
    else:  # where the weights outweigh each process's own memory (imports, Hessians, activations)
        model = save_random_llama(work / "random-2048", fixture("tiny-llama"), vocab_size=4096, hidden_size=2048,
                                  intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                                  max_position_embeddings=512)
    tokens = calibration_tokens(work / "tokens.jsonl", fixture("tiny-llama"))
    recipe = gptq_recipe(work / "gptq-w4.yaml", 4)
    samples = [json.loads(line) for line in tokens.read_text().splitlines() if line.strip()]

    def command(launch: list[str], output: Path) -> list[str]:
        return [*launch, "-m", "llmpress", "oneshot", "--model", str(model), "--recipe", str(recipe), "--dataset", str(tokens),
                "--num-samples", str(len(samples)), "--seq-len", str(len(samples[0]["input_ids"])), "--output", str(output),
                "--overwrite"]

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    runs = {"one process": (work / "one", [sys.executable], [], False),  # (output, launcher, extra flags, under torchrun)
            "2 ranks, forked": (work / "forked", [sys.executable], ["--ranks", "2"], False),
            "2 ranks, torchrun": (work / "torchrun", torchrun, [], True)}
    rows: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(args.runs):
        for name, (output, launch, flags, under_torchrun) in runs.items():
            # timed alone, then sampled: the sampler's reads of smaps_rollup take a core's time,
            # which one process leaves free and two ranks of one thread on two cores do not
            timed = run([*command(launch, output), *flags], under_torchrun, sample=False)
            sampled = run([*command(launch, output), *flags], under_torchrun)
            rows[name].append({**sampled, "wall_s": timed["wall_s"], "sampled_wall_s": sampled["wall_s"]})
        print(json.dumps({k: v[-1] for k, v in rows.items()}), flush=True)
    medians = {name: {k: statistics.median(r[k] for r in found) for k in found[0]} for name, found in rows.items()}
    one = medians["one process"]
    print(f"\nGPTQ W4A16 g128, random {args.hidden}-hidden Llama (8 layers, fp32), 64 x 256 tokens, one thread a process, {args.runs} run(s)")
    print(f"{'':<18} {'wall s':>8} {'peak PSS MB':>12} {'peak RSS MB':>12} {'speed-up':>9} {'PSS ratio':>10} {'bit for bit':>12}")
    for name, row in medians.items():
        equal, total = same_checkpoint(work / "one", runs[name][0]) if name != "one process" else (0, 0)
        same = f"{equal}/{total}" if total else ""
        print(f"{name:<18} {row['wall_s']:>8.1f} {row['pss_mb']:>12.0f} {row['rss_mb']:>12.0f} {one['wall_s'] / row['wall_s']:>8.2f}x "
              f"{row['pss_mb'] / one['pss_mb']:>9.2f}x {same:>12}")
    print("targets (issue 45): speed-up >= 1.7x, summed PSS <= 1.3x one process's, the same checkpoint bit for bit")


if __name__ == "__main__":
    main()
