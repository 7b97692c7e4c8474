"""``oneshot`` and ``train``: compress a model with a recipe, in one call.

``oneshot`` runs one-shot stages on calibration data. ``train`` runs a recipe whose stages may
also train (pruning schedules, QAT, distillation), e.g. GPTQ W4A16 then recovery training with
distillation from the original model, from one YAML file, saving a checkpoint after each stage.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmpress.checkpoint import claimed_output, save_checkpoint
from llmpress.contract.modifier import TRAINING_EVENTS
from llmpress.data import CalibrationOptions, batch_samples, load_calibration_samples, structure_batches
from llmpress.data.keywords import from_llmcompressor_keywords
from llmpress.errors import CheckpointError, DataError, MissingStateError, RecipeError, os_failure
from llmpress.lifecycle.state import Status, status_of
from llmpress.model_free import ModelFreePlan, ModelFreeRefused, plan_model_free, run_plan
from llmpress.models import calibrating_all_experts, linearize_experts
from llmpress.parallel.distributed import broadcast_object, is_distributed, is_main_process, same_on_every_rank, share_of
from llmpress.pipelines.basic import run_basic_calibration
from llmpress.pipelines.layerwise import run_layerwise_calibration
from llmpress.pipelines.storage.resume import WorkFolder, run_fingerprint
from llmpress.pipelines.training import TrainingOptions, run_training, stage_epochs
from llmpress.recipe import Recipe, RecipeStage
from llmpress.session import Session
from llmpress.tensorfiles.dtypes import as_dtype
from llmpress.tensorfiles.folder import model_folder

__all__ = ["is_training_stage", "oneshot", "train"]

logger = logging.getLogger(__name__)


def _read_folder(folder: str | Path, dtype: torch.dtype | str | None, trust_remote_code: bool) -> tuple[nn.Module, Any]:
    """The model of a checkpoint folder and its tokenizer. The loader (and transformers with it)
    is imported here, when a model is read: a model-free run never needs it."""
    from llmpress.loading.loader import read_model_and_processor

    return read_model_and_processor(folder, dtype=dtype, trust_remote_code=trust_remote_code)


def _read_model(model: nn.Module | str | Path, processor: Any, dtype: torch.dtype | str | None,
                trust_remote_code: bool) -> tuple[nn.Module, Any]:
    """``model`` read from its folder in ``dtype`` (None: its config's) with its tokenizer, unless
    it is a module already (then ``dtype`` must not ask for another dtype than it has, and the
    tokenizer is the one in the folder it was read from, as transformers records it)."""
    if isinstance(model, (str, Path)):
        model, loaded = _read_folder(model, dtype, trust_remote_code)
        return model, processor if processor is not None else loaded
    if dtype is not None:
        wanted = as_dtype(dtype)
        held = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if held != {wanted}:
            raise RecipeError(
                "dtype names the dtype a model folder is read in; this model is a module already",
                got=f"dtype={wanted}, a model in {sorted(str(d) for d in held)}",
                expected="dtype=None with a module",
                fix=f"convert it yourself first (model.to({wanted})), or pass the checkpoint folder",
            )
    folder = getattr(model, "name_or_path", None)
    if processor is None and isinstance(folder, str) and folder and Path(folder).is_dir():
        from llmpress.loading.loader import FolderTokenizer  # a transformers model: the tokenizer beside its weights

        processor = FolderTokenizer.of(Path(folder), trust_remote_code)
    return model, processor


def _model_free_plan(model: Any, recipe: Recipe, output_dir: str | Path | None, wanted: bool | None, return_model: bool,
                     resume: bool, dtype: torch.dtype | str | None) -> ModelFreePlan | None:
    """The model-free plan when this run takes that path (``oneshot``'s ``model_free``)."""
    if wanted is False or (wanted is None and (return_model or resume or is_distributed())):
        return None
    if not isinstance(model, (str, Path)) or output_dir is None:
        if wanted:
            raise RecipeError("model_free=True reads a checkpoint folder and writes one",
                              got=f"model {type(model).__name__}, output_dir {output_dir!r}",
                              expected="a model folder and an output_dir")
        return None
    try:
        plan = plan_model_free(model_folder(model), recipe, as_dtype(dtype))
    except ModelFreeRefused as exc:
        if wanted:
            raise
        logger.info("loading the model: %s", exc.args[0] if exc.args else exc)
        return None
    logger.info("the recipe needs no calibration data: quantizing %d weights straight from the checkpoint's shards, "
                "without building the model (model_free=False / --no-model-free loads it instead)", len(plan.schemes))
    return plan


@contextmanager
def _output_for(output_dir: str | Path | None, model: Any, overwrite: bool) -> Iterator[None]:
    """The run's output, claimed before any work (``claimed_output``: checked, locked against a
    second run; an existing folder that is not empty is refused unless it is a checkpoint
    llmpress wrote and ``overwrite``). The system's
    refusals (a full disk under the spill files) come out named (``errors.os_failure``)."""
    try:
        if output_dir is None:
            yield
            return
        with ExitStack() as held:
            refusal = None
            if is_main_process():  # the rank that writes claims the output
                try:
                    held.enter_context(claimed_output(output_dir, model if isinstance(model, (str, Path)) else None, overwrite))
                except CheckpointError as exc:
                    refusal = exc
            if is_distributed():  # every rank stops with the main one's refusal, none waits for it
                refusal = broadcast_object(refusal, src=0)
            if refusal is not None:
                raise refusal
            yield
    except OSError as exc:  # a full disk or a read-only folder under the work or spill files
        raise os_failure(exc, "the run could not read or write its files") from exc


def _require_no_calibration(recipe: Recipe) -> None:
    for modifier in recipe.modifiers:
        if "calibration_data" in modifier.required_state():
            raise MissingStateError(
                f"{type(modifier).__name__} needs 'calibration_data': pass dataset=... to oneshot "
                "(on the command line: --dataset PATH)",
                got="no dataset",
                expected="a text or JSON-lines file, a dataset, or a list of samples",
            )


def oneshot(
    model: nn.Module | str | Path,
    recipe: Any,
    dataset: Any = None,
    *,
    output_dir: str | Path | None = None,
    processor: Any = None,
    calibration: CalibrationOptions | None = None,
    save_compressed: bool = True,
    resume: bool = False,
    return_model: bool = True,
    trust_remote_code: bool = False,
    dtype: torch.dtype | str | None = None,
    model_free: bool | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    **llmcompressor_keywords: Any,
) -> nn.Module | None:
    """Apply ``recipe`` to ``model`` stage by stage, calibrating on ``dataset``; save to
    ``output_dir`` when given; return the compressed model.

    With ``output_dir``, a recipe of one stage keeps each finished layer in a work folder beside
    it (``<output_dir>.llmpress-work``); ``resume=True`` goes on from the last finished layer of
    an interrupted run of the same model, recipe, data and options (the same checkpoint as an
    uninterrupted run), and does nothing, with a warning, when that run already finished. An
    existing output folder that is not empty is refused before any work: one llmpress did not
    write always, a checkpoint it wrote unless ``overwrite=True`` (or ``resume``); one run at a
    time writes an output (a lock beside it, released however the process ends).

    ``return_model=False`` (with ``output_dir``) returns None: the finished layers, held as
    integers while calibration goes on, are written to the checkpoint as they are and never
    rebuilt in float, so the run's peak memory stays that of about one layer (the command line
    runs this way).

    ``trust_remote_code``: a model folder that brings its own Python code is refused unless this
    is True (nothing ever asks on standard input).

    ``model`` is a module or a checkpoint folder (its tokenizer is loaded too when
    ``processor`` is not given). A folder is read in ``dtype``, by default the dtype its config
    names (a bf16 checkpoint stays bf16: its calibration forwards run in bf16, and what is not
    quantized, and every scale, is saved in bf16); statistics (Hessians, ranges, smoothing sums)
    accumulate in float32 whatever the dtype.

    ``model_free``: a recipe that needs no calibration data (one QuantizationModifier: FP8_DYNAMIC,
    FP8_BLOCK, W4A16, NVFP4A16, ...) can run on the checkpoint's shards without building the model
    (``llmpress.model_free``: the same tensors, a few tensors in memory, ``workers`` threads).
    True asks for it (it returns None; a recipe or checkpoint that needs the model class is an
    error); None takes it when ``model`` is a folder, ``output_dir`` is given, no model is
    asked back (``return_model=False``, as on the command line) and the recipe allows it; False
    never. ``dataset`` is a text or JSON-lines file, a dataset folder, a
    ``datasets.Dataset``, or a list of strings or token-id lists; ``calibration`` says how many
    samples of how many tokens to take from it. ``dataset`` may also be a Hugging Face Hub
    dataset id or one of llm-compressor's names for one (``ultrachat_200k``, ``open_platypus``...;
    read from the local cache first), a ``DatasetDict`` or a ``DataLoader``.

    llm-compressor's keyword names are read too (``num_calibration_samples``,
    ``max_seq_length``, ``splits``, ``text_column``, ``preprocessing_func``, ``tokenizer``, ...:
    ``llmpress.data.keywords``), so its scripts run with their imports changed.
    """
    calibration, given = from_llmcompressor_keywords(calibration, llmcompressor_keywords, {
        "processor": processor, "dtype": dtype, "trust_remote_code": trust_remote_code, "dataset": dataset})
    processor, dtype, trust_remote_code, dataset = given["processor"], given["dtype"], given["trust_remote_code"], given["dataset"]
    with _output_for(output_dir, model, overwrite or resume):  # before any work: checked, then locked for the run
        recipe = Recipe.from_any(recipe)
        plan = _model_free_plan(model, recipe, output_dir, model_free, return_model, resume, dtype)
        if plan is not None:
            run_plan(plan, recipe, output_dir, workers=workers)
            return None
        source = _source_folder(model)  # resolved once: read from it, and it identifies the run's weights
        model, processor = _read_model(model if source is None else source, processor, dtype, trust_remote_code)
        options = calibration or CalibrationOptions()
        training = [s.name for s in recipe.stages if is_training_stage(s)]
        if training:
            raise RecipeError(
                f"stage {training[0]!r} trains (pruning schedule, QAT, distillation or learning rate); oneshot only calibrates",
                expected="a recipe of one-shot stages",
                fix="run it with llmpress.train(...) (on the command line: llmpress train)",
            )
        if dataset is None:
            _require_no_calibration(recipe)
        if is_distributed():
            same_on_every_rank(recipe.to_yaml(), "the recipe")
        batches = _calibration_batches(dataset, processor, options, model)
        if batches is None and any(m.structure_from_any_tokens for m in recipe.modifiers):
            batches = structure_batches(getattr(getattr(model, "config", None), "vocab_size", None))
        _release_folder_tokenizer(processor)
        linearize_experts(model)  # MoE experts as one Linear each: what calibrates, saves and runs
        work = _work_folder(model, recipe, batches, options, output_dir, resume, source)
        if resume and work is not None and work.finished:
            logger.warning("%s is already the finished checkpoint of this run: nothing to do", output_dir)
            return model if return_model else None
        keep_held = output_dir is not None and not return_model
        try:
            for number, stage in enumerate(recipe.stages):
                _oneshot_stage(model, stage, batches, processor, options, work, keep_held=keep_held and number == len(recipe.stages) - 1)
            if output_dir is not None:
                save_checkpoint(output_dir, model, processor, save_compressed=save_compressed)
        except BaseException:
            if work is not None:
                work.abandon()
            raise
        if work is not None:
            work.finish()
        return model if return_model else None


def _source_folder(model: nn.Module | str | Path) -> Path | None:
    """The checkpoint folder a model given by name is read from (None for a module)."""
    return model_folder(model) if isinstance(model, (str, Path)) else None


def _release_folder_tokenizer(processor: Any) -> None:
    """Let a folder's tokenizer go once the calibration text is tokenized (``loading/tokenizer.py``):
    it is read again only if asked for, and the save copies its files."""
    from llmpress.loading.loader import FolderTokenizer  # the model is read by now: the loader is imported

    if isinstance(processor, FolderTokenizer):
        processor.release()


def _work_folder(model: nn.Module, recipe: Recipe, batches: Any, options: CalibrationOptions, output_dir: str | Path | None,
                 resume: bool, source: Path | None = None) -> WorkFolder | None:
    """The run's work folder (``pipelines/storage/resume.py``) where it can resume: an output, one
    stage, the layerwise pipeline. ``source``: the folder the model was just read from (its shards
    identify the weights without reading them)."""
    resumable = output_dir is not None and len(recipe.stages) == 1 and options.pipeline == "layerwise" and batches is not None
    if not resumable:
        if resume:
            raise RecipeError(
                "this run cannot resume",
                got=f"{len(recipe.stages)} stage(s), pipeline {options.pipeline!r}, "
                f"{'an' if output_dir is not None else 'no'} output folder, {'no ' if batches is None else ''}calibration data",
                expected="one one-shot stage on the layerwise pipeline with calibration data, saved to an output folder",
                fix="run without --resume",
            )
        return None
    return WorkFolder.open(output_dir, run_fingerprint(model, recipe, batches, options, source), resume)


def _calibration_batches(dataset: Any, processor: Any, options: CalibrationOptions, model: nn.Module) -> list[torch.Tensor] | None:
    """The calibration batches; under torch.distributed, this rank's share of them (every rank
    loads the same samples and batches them alike, then takes every ``world_size``-th batch: the
    batches are those of one process, so are the statistics summed over them). Token ids must be
    below the model's vocabulary size."""
    if dataset is None:
        return None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    batches = batch_samples(load_calibration_samples(dataset, processor, options, vocab), options.batch_size)
    if is_distributed():
        same_on_every_rank([b.tolist() for b in batches], "the calibration samples")
        batches = share_of(batches, "calibration batches")
    return batches


def _oneshot_stage(model: nn.Module, stage: RecipeStage, batches: Any, processor: Any, options: CalibrationOptions,
                   work: WorkFolder | None = None, keep_held: bool = False) -> None:
    logger.info("running one-shot stage %s", stage.name)
    model.eval()
    session = Session(Recipe([stage]))
    with session, calibrating_all_experts(model, options.calibrate_all_experts):
        session.initialize(model=model, calibration_data=batches, processor=processor)
        if options.pipeline == "layerwise":
            run_layerwise_calibration(model, session, batches or [], true_sequential=options.true_sequential, work=work,
                                      spill=options.spill_activations, keep_held=keep_held, device=options.device,
                                      compute_dtype=options.compute_dtype)
        else:
            run_basic_calibration(model, session, batches or [])
        session.finalize()


def is_training_stage(stage: RecipeStage) -> bool:
    """``run_type: train`` / ``oneshot`` when the stage says; else whether a modifier of it acts
    on training events or has a start/end window in epochs (a stage of a plain
    QuantizationModifier is one-shot RTN)."""
    if stage.run_type is not None:
        if stage.run_type not in ("train", "oneshot"):
            raise RecipeError(f"stage {stage.name!r}: unknown run_type", got=stage.run_type, expected="'oneshot' or 'train'")
        return stage.run_type == "train"
    return any(set(m.events) & set(TRAINING_EVENTS) or m.window.is_timed for m in stage.modifiers)


def train(
    model: nn.Module | str | Path,
    recipe: Any,
    dataset: Any,
    *,
    output_dir: str | Path | None = None,
    processor: Any = None,
    teacher: nn.Module | str | Path | None = None,
    training: TrainingOptions | None = None,
    calibration: CalibrationOptions | None = None,
    save_compressed: bool = True,
    trust_remote_code: bool = False,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
) -> nn.Module:
    """Apply ``recipe`` stage by stage: one-shot stages calibrate on ``dataset``, training stages
    train on it (causal LM loss, AdamW, ``training`` options). With ``output_dir``, each stage but
    the last is saved to ``output_dir/<stage name>`` and the result to ``output_dir``.

    ``teacher`` (a model or a checkpoint folder) is what distillation learns from; when a stage
    distills and none is given, it is a copy of ``model`` as it was before the first stage.
    ``dtype``: as in ``oneshot`` (the model's, and a teacher folder's, own by default);
    ``overwrite``: as in ``oneshot``.
    """
    with _output_for(output_dir, model, overwrite):  # before any work: checked, then locked for the run
        model, processor = _read_model(model, processor, dtype, trust_remote_code)
        if dataset is None:
            raise DataError("train needs a dataset to calibrate and train on", got="no dataset", expected="a text or JSON-lines file, a dataset, or a list of samples")
        recipe = Recipe.from_any(recipe)
        if is_distributed() and any(is_training_stage(s) for s in recipe.stages):
            raise RecipeError(
                "llmpress.train runs its training stages in one process",
                got=f"a training stage under torch.distributed ({torch.distributed.get_world_size()} ranks)",
                expected="train() in a single process",
                fix="train on several ranks with LlmpressTrainer (FSDP) or your own loop with a Session "
                "(examples/prune_fsdp.py); oneshot() calibrates on several ranks",
            )
        linearize_experts(model)
        options = training or TrainingOptions()
        calibration = calibration or CalibrationOptions()
        if isinstance(teacher, (str, Path)):
            teacher, _ = _read_folder(teacher, dtype, trust_remote_code)
        if teacher is None and any("teacher" in m.required_state() for m in recipe.modifiers):
            logger.info("distilling from a copy of the model as it was before the first stage")
            teacher = copy.deepcopy(model).eval()
        calibration_batches = train_batches = None
        for i, stage in enumerate(recipe.stages):
            if is_training_stage(stage):
                if train_batches is None:
                    sampling = CalibrationOptions(
                        num_samples=options.num_samples, seq_len=options.seq_len, seed=options.seed, batch_size=options.batch_size
                    )
                    train_batches = _calibration_batches(dataset, processor, sampling, model)
                _training_stage(model, stage, train_batches, processor, teacher, options)
            else:
                if calibration_batches is None:
                    calibration_batches = _calibration_batches(dataset, processor, calibration, model)
                _oneshot_stage(model, stage, calibration_batches, processor, calibration)
            if output_dir is not None and i < len(recipe.stages) - 1:
                save_checkpoint(Path(output_dir) / stage.name, model, processor, save_compressed=save_compressed)
        if output_dir is not None:
            save_checkpoint(output_dir, model, processor, save_compressed=save_compressed)
        return model


def _freeze_quantized_weights(model: nn.Module) -> None:
    """Weights an earlier stage put on their grid stay there unless this stage trains them with
    QAT (a QuantizationModifier of its own): plain steps would move them off the grid."""
    frozen = [
        m for m in model.modules()
        if status_of(m) == Status.FROZEN and getattr(m, "weight_scale", None) is not None
        and isinstance(getattr(m, "weight", None), torch.nn.Parameter) and m.weight.requires_grad
    ]
    for module in frozen:
        module.weight.requires_grad_(False)
    if frozen:
        logger.info(
            "%d quantized module(s) keep their weights fixed in this stage; add a QuantizationModifier "
            "to the stage to train them with QAT", len(frozen),
        )


def _training_stage(model: nn.Module, stage: RecipeStage, batches: list[torch.Tensor], processor: Any, teacher: Any, options: TrainingOptions) -> None:
    logger.info("running training stage %s", stage.name)
    session = Session(Recipe([stage]))
    with session:
        # every weight trains unless an earlier stage fixed it on its grid (decided just below,
        # once this stage's QAT modules are known); a frozen QAT weight of an earlier stage
        # trains again when this stage quantizes it too
        for parameter in model.parameters():
            if parameter.is_floating_point():
                parameter.requires_grad_(True)
        parameters = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=options.lr, weight_decay=options.weight_decay)
        session.initialize(model=model, optimizer=optimizer, steps_per_epoch=len(batches), teacher=teacher, processor=processor)
        _freeze_quantized_weights(model)
        run_training(model, session, batches, optimizer, epochs=stage_epochs(session, options), max_steps=options.max_steps, seed=options.seed)
        session.finalize()
