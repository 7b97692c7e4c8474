"""Prune a model to 50% with FSDP2 (fully_shard) on several ranks, with distillation from the dense model.

    torchrun --nproc-per-node 2 examples/prune_fsdp.py --model assets/tiny-llama \\
        --text assets/text/calibration.txt --output out/pruned-fsdp

Each decoder layer and the model are sharded with ``fully_shard`` (gloo on CPU, NCCL on GPUs):
every rank holds its rows of each weight and trains on its share of the batches. The session's
modifiers act on the shards: a pruning mask is decided on the whole weight (its global share of
zeros) and applied shard by shard after each optimizer step; the teacher is replicated, or
sharded the same way with ``--shard-teacher``. The save
gathers the whole weights on rank 0 (``unwrap_if_fsdp``), which writes the one checkpoint.
"""

from __future__ import annotations

import copy
import logging
import math

import torch
from _shared import load_everything, parse_args, report
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import llmpress
from llmpress.contract.block import find_blocks
from llmpress.evaluation import perplexity
from llmpress.parallel.distributed import is_main_process, ranks_from_environment, share_of, world_size


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """Each repeated block its own FSDP unit, then the rest of the model."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world_size(),))
    for block in find_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [("--shard-teacher", {"action": "store_true",
                                                  "help": "shard the teacher too (default: every rank holds it whole)"})])
    logging.basicConfig(level=logging.WARNING)
    with ranks_from_environment() as main_process:
        model, tokenizer, samples, windows = load_everything(args)
        before = perplexity(model, windows, progress=False).perplexity if main_process else None
        teacher = copy.deepcopy(model).eval()  # replicated: every rank has the whole dense model ...
        if args.shard_teacher:
            teacher = shard(teacher)  # ... or its shards, gathered layer by layer in its forward
        batches = share_of(list(torch.stack(samples).split(args.batch_size)), "training batches")
        model = shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

        with llmpress.Session(args.recipe) as session:
            session.initialize(model=model, teacher=teacher, optimizer=optimizer, steps_per_epoch=len(batches))
            model.train()
            generator = torch.Generator().manual_seed(args.seed)  # the same order on every rank
            for index in range(math.ceil(args.epochs * len(batches))):
                if index % len(batches) == 0:
                    order = torch.randperm(len(batches), generator=generator).tolist()
                batch = batches[order[index % len(batches)]]
                with session.training_step() as step:
                    loss = step.loss(model(input_ids=batch, labels=batch).loss)
                    loss.backward()
                    step.optimizer_step(optimizer)
                    optimizer.zero_grad()
                if index % 10 == 0 and is_main_process():
                    print(f"step {session.step:4d}  epoch {session.epoch:.2f}  loss {loss.item():.3f}", flush=True)
            model.eval()
            session.finalize()

        # every rank takes part in gathering the shards; rank 0 writes the one checkpoint
        llmpress.save_checkpoint(args.output, model, tokenizer)
        if main_process:
            report(before, args.output, windows)


if __name__ == "__main__":
    main()
