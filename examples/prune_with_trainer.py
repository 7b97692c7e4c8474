"""Prune a model to 50% inside Hugging Face's Trainer, with distillation from the dense model.

    python examples/prune_with_trainer.py --model assets/tiny-llama \\
        --text assets/text/calibration.txt --output out/pruned-trainer

    # FSDP2 on GPUs, one rank per GPU: the Trainer shards each decoder layer
    torchrun --nproc-per-node N examples/prune_with_trainer.py --fsdp ...

``LlmpressTrainer`` is ``transformers.Trainer`` plus a session: a callback sends each step's
events, ``compute_loss`` adds the distillation term, and every checkpoint (one per epoch here,
then the final one) goes through llmpress's save path with its sparsity and recipe.
"""

from __future__ import annotations

import copy
import logging

from _shared import load_everything, parse_args, report
from transformers import TrainingArguments

from llmpress.evaluation import perplexity
from llmpress.integrations.trainer import LlmpressTrainer
from llmpress.parallel.distributed import is_main_process

#: the Trainer's FSDP2: each decoder layer (the model's ``_no_split_modules``) sharded over the ranks
FSDP = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2, "reshard_after_forward": True}}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [("--fsdp", {"action": "store_true",
                                                 "help": "shard with FSDP2 on the GPUs (under torchrun)"})])
    logging.basicConfig(level=logging.WARNING)
    model, tokenizer, samples, windows = load_everything(args)
    before = perplexity(model, windows, progress=False).perplexity if is_main_process() else None
    teacher = copy.deepcopy(model)

    training_args = TrainingArguments(
        output_dir=args.output,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        save_strategy="epoch",
        logging_steps=10,
        report_to=[],
        use_cpu=not args.fsdp,
        seed=args.seed,
        **(FSDP if args.fsdp else {}),
        disable_tqdm=None,
    )
    trainer = LlmpressTrainer(
        model=model,
        args=training_args,
        train_dataset=[{"input_ids": s, "labels": s} for s in samples],
        processing_class=tokenizer,
        recipe=args.recipe,
        teacher=teacher,
    )
    trainer.train()  # the session is initialized at the start and finalized at the end
    trainer.save_model(args.output)  # under FSDP: the shards gathered, rank 0 writes
    if is_main_process():
        report(before, args.output, windows)


if __name__ == "__main__":
    main()
