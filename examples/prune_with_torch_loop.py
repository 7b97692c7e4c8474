"""Prune a model to 50% in a plain PyTorch loop, with distillation from the dense model.

    python examples/prune_with_torch_loop.py --model assets/tiny-llama \\
        --text assets/text/calibration.txt --output out/pruned-loop

The model, the optimizer and the teacher come from three different functions, each handing its
piece to the active session; ``initialize()`` runs once everything is there. Each batch is one
``with session.training_step() as step:`` block.
"""

from __future__ import annotations

import copy
import logging
import math

import torch
from _shared import load_everything, parse_args, report

import llmpress
from llmpress.evaluation import perplexity


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    llmpress.active_session().update_state(model=model)
    return model


def prepare_optimizer(model: torch.nn.Module, lr: float, steps_per_epoch: int) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    llmpress.active_session().update_state(optimizer=optimizer, steps_per_epoch=steps_per_epoch)
    return optimizer


def prepare_teacher(model: torch.nn.Module) -> None:
    llmpress.active_session().update_state(teacher=copy.deepcopy(model).eval())


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    logging.basicConfig(level=logging.WARNING)
    model, tokenizer, samples, windows = load_everything(args)
    before = perplexity(model, windows, progress=False).perplexity
    batches = list(torch.stack(samples).split(args.batch_size))

    with llmpress.Session(args.recipe) as session:
        prepare_teacher(model)  # before any weight changes
        model = prepare_model(model)
        optimizer = prepare_optimizer(model, args.lr, steps_per_epoch=len(batches))
        session.initialize()

        model.train()
        generator = torch.Generator().manual_seed(args.seed)
        for index in range(math.ceil(args.epochs * len(batches))):
            if index % len(batches) == 0:
                order = torch.randperm(len(batches), generator=generator).tolist()
            batch = batches[order[index % len(batches)]]
            with session.training_step() as step:
                loss = step.loss(model(input_ids=batch, labels=batch).loss)
                loss.backward()
                step.optimizer_step(optimizer)
                optimizer.zero_grad()
            if index % 10 == 0:
                print(f"step {session.step:4d}  epoch {session.epoch:.2f}  loss {loss.item():.3f}", flush=True)
        model.eval()
        session.finalize()

    # the one save path (model.save_pretrained(args.output) lands there too, without the tokenizer)
    llmpress.save_checkpoint(args.output, model, tokenizer)
    report(before, args.output, windows)


if __name__ == "__main__":
    main()
