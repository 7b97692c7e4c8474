"""Mixed precision to a budget: the menu and its costs, the knapsack against brute force, the
Fisher sensitivities, groups vLLM fuses, and a checkpoint that fits its target and loads."""

from __future__ import annotations

import itertools
import json
import logging
import random
import re
import subprocess
import sys

import pytest
import torch
from helpers import logits, make_tiny_llama, text_path, token_batches, trained_model_dir

import llmpress
from llmpress.errors import DataError, MissingStateError, RecipeError
from llmpress.modifiers import GPTQModifier, MixedPrecisionModifier, QuantizationModifier
from llmpress.modifiers.hessians import accumulate
from llmpress.modifiers.mixed_precision.budget import Group, choose_options
from llmpress.modifiers.mixed_precision.measure import measure
from llmpress.modifiers.mixed_precision.menu import DEFAULT_MENU, DENSE, MixedPrecision, default_menu, menu_option, weight_bits
from llmpress.modifiers.mixed_precision.report import choice_summary, plot_choice
from llmpress.modifiers.mixed_precision.sensitivity import module_groups, round_to_nearest
from llmpress.recipe import Recipe


def test_menu_names_read_as_their_schemes():
    w3 = menu_option("w3a16_g32").scheme.weights
    assert (w3.num_bits, w3.group_size, w3.symmetric, w3.strategy) == (3, 32, True, "group")
    assert menu_option("W2A16_ASYM").scheme.weights.symmetric is False
    assert menu_option("W4A16").scheme.weights.group_size == 128
    assert menu_option("dense") == menu_option("NONE") and menu_option(DENSE).scheme is None
    assert menu_option("NVFP4A16").scheme.weights.is_float
    custom = menu_option({"name": "mine", "weights": {"num_bits": 6, "strategy": "channel"}})
    assert custom.name == "mine" and custom.scheme.weights.num_bits == 6


@pytest.mark.parametrize("entry, words", [("W9A16", "unknown scheme"), ("NVFP4A16_G32", "group size"), ("FP8_G64", "group size")])
def test_menu_entries_that_mean_nothing_are_refused(entry, words):
    with pytest.raises(RecipeError, match=words):
        menu_option(entry)


def test_a_choice_needs_one_target_and_a_menu_of_one_input_kind():
    with pytest.raises(RecipeError, match="exactly one target"):
        MixedPrecision()
    with pytest.raises(RecipeError, match="exactly one target"):
        MixedPrecision(average_bits=4, size="1MB")
    with pytest.raises(RecipeError, match="cannot read the size"):
        MixedPrecision(size="lots")
    with pytest.raises(RecipeError, match="at least two"):
        MixedPrecision(average_bits=4, schemes=["W4A16"])
    with pytest.raises(RecipeError, match="inputs alike"):
        MixedPrecision(average_bits=4, schemes=["W4A16", "W8A8"])
    assert [o.name for o in MixedPrecision(size="2MB", schemes="W4A16, W8A16").options()] == ["W4A16", "W8A16"]


def test_the_default_menu_starts_at_the_targets_whole_bits():
    assert default_menu(4.25) == ["W4A16", "W4A16_G32", "W8A16", DENSE]
    assert default_menu(3.5) == ["W3A16", "W3A16_G32", "W4A16", "W4A16_G32", "W8A16", DENSE]
    assert default_menu(2.2)[:2] == ["W2A16", "W2A16_G32"] and default_menu(6.0) == default_menu(4.0)
    assert [o.name for o in MixedPrecision(size="1MB").options(4.6)] == default_menu(4.6)
    assert [o.name for o in MixedPrecision(size="1MB").options()] == list(DEFAULT_MENU)
    assert [o.name for o in MixedPrecision(average_bits=3.9, schemes=["W8A16", "W2A16"]).options()] == ["W8A16", "W2A16"]


def test_a_schemes_bits_count_values_scales_and_zero_points_as_stored():
    bf16 = torch.bfloat16
    assert weight_bits(None, 64, 256, bf16) == 64 * 256 * 16
    assert weight_bits(menu_option("W4A16").scheme, 64, 256, bf16) == 64 * 256 * 4 + 64 * 2 * 16
    assert weight_bits(menu_option("W4A16_ASYM").scheme, 64, 256, torch.float32) == 64 * 256 * 4 + 64 * 2 * (32 + 4)
    # 200 values of 3 bits fill 19 words a row; no group vLLM takes divides 200, so 7 groups of 32 (the last short)
    assert weight_bits(menu_option("W3A16_G32").scheme, 10, 200, bf16) == 10 * 19 * 32 + 10 * 7 * 16
    nvfp4 = weight_bits(menu_option("NVFP4A16").scheme, 64, 256, bf16)
    assert nvfp4 == 64 * 256 * 4 + 64 * 16 * 8 + 32
    # 576 columns take groups of 64 for 128, as the recipe would
    assert weight_bits(menu_option("W4A16").scheme, 8, 576, bf16) == 8 * 576 * 4 + 8 * 9 * 16


def _brute_force(groups: list[Group], budget: float) -> float:
    best = float("inf")
    for picks in itertools.product(*[range(len(g.bits)) for g in groups]):
        if sum(g.bits[p] for g, p in zip(groups, picks)) <= budget:
            best = min(best, sum(g.sensitivity[p] for g, p in zip(groups, picks)))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_the_choice_fits_the_budget_and_comes_close_to_the_best(seed):
    rng = random.Random(seed)
    groups = []
    for _ in range(rng.randint(2, 6)):
        size = rng.choice([1, 2, 4])
        bits = [size * b for b in (3, 4, 5, 8, 16)]
        error = rng.uniform(0.1, 10) * size
        groups.append(Group([f"m{len(groups)}"], bits, [error * 2.0 ** (-2 * b / size) * rng.uniform(0.8, 1.2) if b != 16 * size else 0.0
                                                        for b in bits]))
    cheapest, dearest = sum(min(g.bits) for g in groups), sum(max(g.bits) for g in groups)
    budget = rng.uniform(cheapest, dearest)
    picks = choose_options(groups, budget)
    assert sum(g.bits[p] for g, p in zip(groups, picks)) <= budget
    found = sum(g.sensitivity[p] for g, p in zip(groups, picks))
    assert found <= 1.25 * _brute_force(groups, budget) + 1e-12


def test_the_choice_spends_more_bits_where_they_save_more_and_refuses_too_small_a_budget():
    sensitive = Group(["a"], [30, 40, 80], [100.0, 10.0, 0.0])
    robust = Group(["b"], [30, 40, 80], [1.0, 0.5, 0.0])
    assert choose_options([sensitive, robust], 70) == [1, 0]
    assert choose_options([sensitive, robust], 160) == [2, 2]
    assert choose_options([sensitive, robust], 60) == [0, 0]
    with pytest.raises(RecipeError, match="below the cheapest"):
        choose_options([sensitive, robust], 59)


def test_sensitivities_leave_the_model_as_it_was_and_rank_the_widths():
    model = make_tiny_llama()
    before = {n: (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    rows = [torch.tensor(b) for b in token_batches(4, 32)]
    options = MixedPrecision(average_bits=5, schemes=["W2A16", "W4A16_G32", "W8A16", DENSE]).options()
    measured = measure(model, modules, rows, options)
    assert all(p.requires_grad == before[n][1] and torch.equal(p, before[n][0]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert measured.tokens == 4 * 32
    layer = "model.layers.1."
    assert measured.input_of[layer + "self_attn.v_proj"] == layer + "self_attn.q_proj"  # one input, one Hessian
    assert all(bool(g.gt(0).all()) for g in measured.output_grads.values())
    for values in measured.costs.values():
        assert values[0] > values[1] > values[2] > values[3] == 0.0
    # the cost is 1/2 sum_i g_i dW_i H dW_i^T with H the Hessian of the inputs the whole model gives
    # the second block's down_proj (the blocks ran one by one on kept inputs: the same ones)
    seen = []
    down = model.model.layers[1].mlp.down_proj
    hook = down.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for row in rows:
            model(input_ids=row[None])
    hook.remove()
    inputs = torch.cat(seen).double()
    error = (round_to_nearest(down.weight.detach(), None, options[1].scheme) - down.weight.detach()).double()
    grads = measured.output_grads[layer + "mlp.down_proj"] / measured.tokens
    expected = 0.5 * float((grads * ((error @ (inputs.t() @ inputs)) * error).sum(1)).sum())
    assert measured.costs[layer + "mlp.down_proj"][1] == pytest.approx(expected, rel=1e-4)


def test_the_hessians_of_one_layer_at_a_time_are_alive(monkeypatch):
    """Summed for every module at once, the Hessians outweighed the model (32 GB for a Llama-3-8B):
    the blocks are weighed one after another, each one's Hessians freed before the next's exist."""
    import weakref

    live: list[weakref.ref] = []
    most = 0
    made = accumulate.HessianAccumulator.__init__

    def counted(self, *args, **kwargs):
        nonlocal most
        made(self, *args, **kwargs)
        live.append(weakref.ref(self))
        most = max(most, sum(ref() is not None for ref in live))

    monkeypatch.setattr(accumulate.HessianAccumulator, "__init__", counted)
    model = make_tiny_llama()
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}  # lm_head too: outside the blocks
    runs = []
    hook = model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda *_: runs.append(torch.is_grad_enabled()))
    measured = measure(model, modules, [torch.tensor(b) for b in token_batches(3, 16)],
                       MixedPrecision(average_bits=5, schemes=["W4A16_G32", DENSE]).options())
    hook.remove()
    assert len(live) == 9  # q/k/v, o, gate/up and down in each of the two layers, and lm_head
    assert most == 4  # one layer's four inputs
    assert all(measured.costs[name][0] > 0 for name in modules)
    # the backward passes keep each block's inputs, not its activations: it runs again to give them
    # (twice a row with gradients), and once more, without, as the blocks are weighed one by one
    assert runs == [True, True] * 3 + [False] * 3
    assert not any("forward" in block.__dict__ for block in model.model.layers)


def test_modules_reading_one_input_are_one_group():
    model = make_tiny_llama()
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    options = MixedPrecision(average_bits=5, schemes=["W4A16_G32", DENSE]).options()
    groups = module_groups(modules, measure(model, modules, [torch.tensor(token_batches(1, 16)[0])], options).input_of)
    short = [[n.split(".", 3)[3] for n in g] for g in groups]
    assert short[:4] == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                         ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    assert len(groups) == 8


def test_gptq_weighs_each_scheme_by_what_gptq_leaves():
    """With GPTQ after it, a scheme costs what GPTQ's rounding costs: less than round-to-nearest's."""
    model = make_tiny_llama()
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    rows = [torch.tensor(b) for b in token_batches(8, 32)]
    options = MixedPrecision(average_bits=4, schemes=["W3A16_G32", "W4A16_G32"]).options()
    rtn = measure(model, modules, rows, options, round_to_nearest).costs
    gptq = GPTQModifier(scheme="W4A16")
    solved = measure(model, modules, rows, options, gptq._rounding).costs
    assert sum(v[0] for v in solved.values()) < sum(v[0] for v in rtn.values())
    assert all(solved[n][0] > solved[n][1] for n in modules)
    assert getattr(gptq, "_last_factor", None) is None  # each Hessian's factor went with it


@pytest.mark.parametrize("experts", ["shared", "per_block"])
def test_a_moes_experts_take_one_scheme_written_as_experts(experts, caplog):
    """By default every expert of the model takes one scheme (transformers 5 reads one for all);
    ``per_block`` gives each experts block its own, and the save says transformers cannot read it
    where the blocks' choices differ."""
    from helpers import tiny_of_family

    from llmpress.checkpoint.compressed_state import quantization_config_for
    from llmpress.models.experts import linearize_experts

    model = tiny_of_family("qwen3_moe")
    linearize_experts(model)
    batches = [torch.tensor(b) for b in token_batches(4, 16, vocab=model.config.vocab_size)]
    mixed = {"average_bits": 6, "schemes": ["W4A16_G32", "W8A16"], "experts": experts}
    out = llmpress.oneshot(model, [QuantizationModifier(mixed_precision=mixed, ignore=["lm_head", "re:.*gate$"])], batches)
    record = out.config.llmpress_mixed_precision
    groups = [g for g in record["groups"] if any(".experts." in m for m in g["modules"])]
    assert groups and all(all(".experts." in m for m in g["modules"]) for g in groups)
    layers = [{m.split(".experts.")[0] for m in g["modules"]} for g in groups]
    assert all(len(g["modules"]) == 2 * 4 * 3 // len(groups) for g in groups)  # every expert's gate, up and down
    assert len(groups) == (1 if experts == "shared" else 2) and sum(map(len, layers)) == 2
    with caplog.at_level(logging.WARNING):
        config = quantization_config_for(out, True)
    for group in config["config_groups"].values():
        named = [t for t in group["targets"] if ".experts." in t or "experts\\." in t]
        assert all(t.startswith("re:") for t in named)  # one pattern a projection or block, not a name an expert
    assert any(t.startswith("re:") and "experts" in t for g in config["config_groups"].values() for t in g["targets"])
    differ = len({g["chosen"] for g in groups}) > 1
    assert ("transformers (5.17-5.25) reads one scheme" in caplog.text) == differ


def test_a_mixed_moe_checkpoint_loads_in_transformers_as_in_llmpress(tmp_path):
    """transformers 5 builds a Qwen3-MoE block's experts as one module and takes their scheme
    from the config group whose ``re:`` target names experts: it found none (the experts' groups
    of 64 were named by their last names), took the attention's 8-bit group, and refused."""
    from helpers import tiny_of_family
    from transformers import AutoModelForCausalLM

    tiny_of_family("qwen3_moe").save_pretrained(tmp_path / "model")
    batches = [torch.tensor(b) for b in token_batches(8, 32, vocab=512)]
    out = tmp_path / "out"
    llmpress.oneshot(str(tmp_path / "model"), [QuantizationModifier(mixed_precision={"average_bits": 5}, ignore=["lm_head"])],
                     batches, output_dir=out, return_model=False)
    config = json.loads((out / "config.json").read_text())
    assert len({g["chosen"] for g in config["llmpress_mixed_precision"]["groups"]}) >= 2
    ids = torch.tensor([token_batches(1, 24, seed=3, vocab=512)[0]])
    ours = logits(llmpress.load(out, dtype=torch.float32, dequantize=True), ids)
    theirs = logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), ids)
    assert ((theirs - ours).norm() / ours.norm()) < 1e-4


@pytest.fixture(scope="module")
def mixed_checkpoint(tmp_path_factory):
    """The trained tiny Llama in bf16, GPTQ at 3.5 bits per weight from the default menu."""
    out = tmp_path_factory.mktemp("mixed") / "out"
    recipe = """
quant_stage:
  quant_modifiers:
    MixedPrecisionModifier:
      average_bits: 3.5
      samples: 16
      ignore: [lm_head]
    GPTQModifier: {}
"""
    llmpress.oneshot(str(trained_model_dir()), recipe, str(text_path("calibration.txt")), output_dir=out, dtype="bfloat16",
                     calibration=llmpress.CalibrationOptions(num_samples=16, seq_len=128), return_model=False)
    return out


def test_a_mixed_checkpoint_fits_its_target_and_says_what_it_chose(mixed_checkpoint):
    config = json.loads((mixed_checkpoint / "config.json").read_text())
    record = config["llmpress_mixed_precision"]
    assert record["average_bits"] <= 3.5 and record["target"] == {"average_bits": 3.5}
    chosen = {g["chosen"] for g in record["groups"]}
    assert len(chosen) >= 2  # mixed, not one scheme
    groups = config["quantization_config"]["config_groups"]
    assert len(groups) == len(chosen - {DENSE})
    by_module = {m: g["chosen"] for g in record["groups"] for m in g["modules"]}
    for layer in range(4):  # q/k/v and gate/up share a scheme: vLLM fuses them
        prefix = f"model.layers.{layer}."
        assert len({by_module[prefix + f"self_attn.{p}_proj"] for p in "qkv"}) == 1
        assert len({by_module[prefix + f"mlp.{p}_proj"] for p in ("gate", "up")}) == 1
    recipe = (mixed_checkpoint / "recipe.yaml").read_text()
    assert "GPTQModifier" in recipe and "average_bits: 3.5" in recipe
    lines = choice_summary(record)
    assert "3.5" in lines[0] and len(lines) == 2 + 4  # the target, the header, one row a layer


def test_a_mixed_checkpoint_loads_in_transformers_as_in_llmpress(mixed_checkpoint):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([token_batches(1, 24)[0]])
    ours = logits(llmpress.load(mixed_checkpoint, dtype=torch.float32, dequantize=True), ids)
    theirs = logits(AutoModelForCausalLM.from_pretrained(mixed_checkpoint, dtype=torch.float32).eval(), ids)
    assert ((theirs - ours).norm() / ours.norm()) < 1e-4


def test_a_module_given_a_smaller_group_is_named_by_one_config_group_only(tmp_path):
    """down_proj's 192 inputs take groups of 64 where the choice gave it groups of 128: its own
    config group names it, and the choice's group of 128 no longer does (compressed-tensors took
    that one, and refused the file)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    batches = [torch.tensor(b) for b in token_batches(4, 32)]
    model = llmpress.oneshot(make_tiny_llama(intermediate=192), [QuantizationModifier(
        mixed_precision={"average_bits": 4.3, "schemes": ["W4A16", "W8A16"]}, ignore=["lm_head"])], batches, output_dir=out)
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    named = [name for group in groups for name in group["targets"]]
    assert len(named) == len(set(named))
    assert any(g["weights"]["group_size"] == 64 and any("down_proj" in t for t in g["targets"]) for g in groups)
    ids = torch.tensor([token_batches(1, 24, seed=3)[0]])
    theirs = logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), ids)
    assert ((theirs - logits(model, ids)).norm() / logits(model, ids).norm()) < 1e-4


def test_inspect_shows_the_choice_and_plots_it(mixed_checkpoint, tmp_path):
    png = tmp_path / "choice.png"
    result = subprocess.run([sys.executable, "-m", "llmpress", "inspect", str(mixed_checkpoint), "--plot", str(png)],
                            capture_output=True, text=True, check=True)
    assert "mixed precision: " in result.stdout and "q/k/v" in result.stdout and "gate/up" in result.stdout
    assert "vLLM's CPU build refuses int3 weight-only layers" in result.stdout  # 3.5 bits on average: some 3-bit groups
    assert png.read_bytes()[:4] == b"\x89PNG"
    record = json.loads((mixed_checkpoint / "config.json").read_text())["llmpress_mixed_precision"]
    assert plot_choice(record, tmp_path / "again.png").stat().st_size > 0


@pytest.mark.parametrize("tie", [False, True])
def test_a_size_target_bounds_the_whole_file(tmp_path, tie):
    """Tied: the head is targeted, so it is untied and the embeddings are stored beside it; the
    budget counted neither (one tensor, and the head's), and the file came out 29% over."""
    model = make_tiny_llama(tie=tie)
    dense = sum(p.numel() * 4 for p in model.parameters()) + (model.lm_head.weight.numel() * 4 if tie else 0)
    size = int(dense * (0.4 if tie else 0.55))
    out = tmp_path / "out"
    batches = [torch.tensor(b) for b in token_batches(4, 32)]
    llmpress.oneshot(model, [QuantizationModifier(mixed_precision={"size": size, "schemes": ["W4A16_G32", "W8A16", DENSE]},
                                                  ignore=[] if tie else ["lm_head"])], batches, output_dir=out)
    written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert written <= size and written > 0.9 * size


@pytest.mark.parametrize("target", [{"average_bits": 3.9}, {"size": "10KB"}])
def test_a_target_below_the_cheapest_scheme_is_refused_before_anything_is_measured(monkeypatch, target):
    import llmpress.modifiers.mixed_precision.choose as choose

    monkeypatch.setattr(choose, "measure", lambda *a, **k: pytest.fail("measured a choice that cannot fit"))
    batches = [torch.tensor(b) for b in token_batches(2, 16)]
    choice = {**target, "schemes": ["W4A16", "W8A16"]}
    with pytest.raises(RecipeError, match="below the cheapest") as refused:
        llmpress.oneshot(make_tiny_llama(), [QuantizationModifier(mixed_precision=choice, ignore=["lm_head"])], batches)
    said = str(refused.value)
    assert re.search(r"at least 4\.\d+ bits per targeted weight" if "average_bits" in target else r"at least \d+\.\d\d MB", said)
    assert "every module at its cheapest: W4A16 for 14" in said


def test_the_command_line_turns_a_recipe_into_a_mixed_one(tmp_path):
    out = tmp_path / "out"
    ran = subprocess.run([sys.executable, "-m", "llmpress", "oneshot", "--model", str(trained_model_dir()), "--recipe", "W4A16",
                          "--average-bits", "4.25", "--schemes", "W3A16,W4A16_G32,W8A16", "--dataset", str(text_path("calibration.txt")),
                          "--num-samples", "8", "--seq-len", "64", "--output", str(out)], check=True, capture_output=True, text=True)
    record = json.loads((out / "config.json").read_text())["llmpress_mixed_precision"]
    assert record["menu"] == ["W3A16", "W4A16_G32", "W8A16"] and record["average_bits"] <= 4.25
    assert record["samples"] == 8  # the sequences measured, not the most it would take (32)
    said = ran.stdout.splitlines()  # the choice by layer, as inspect shows it
    assert said[1].startswith("mixed precision: ") and "on 8 sequences" in said[1] and said[2].split() == ["layer", "q/k/v", "o", "gate/up", "down"]


def test_the_command_line_gives_each_experts_block_its_own_scheme_when_asked(tmp_path, capsys):
    from helpers import tiny_of_family

    from llmpress.cli import main

    tiny_of_family("qwen3_moe").save_pretrained(tmp_path / "model")
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in token_batches(8, 32, vocab=512)))
    common = ["oneshot", "--model", str(tmp_path / "model"), "--recipe", "W4A16", "--dataset", str(data), "--num-samples", "8",
              "--seq-len", "32"]
    assert main([*common, "--experts", "per_block", "--output", str(tmp_path / "refused")]) != 0
    assert "--experts per_block" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    assert main([*common, "--average-bits", "5", "--experts", "per_block", "--output", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "config.json").read_text())["llmpress_mixed_precision"]
    assert len([g for g in record["groups"] if any(".experts." in m for m in g["modules"])]) == 2  # one per block


def test_without_calibration_data_mixed_precision_is_refused_with_the_fix():
    with pytest.raises(DataError, match="calibration data"):
        llmpress.oneshot(make_tiny_llama(), [MixedPrecisionModifier(average_bits=4.5)], [])
    with pytest.raises(MissingStateError, match="needs 'calibration_data'"):
        llmpress.oneshot(make_tiny_llama(), [MixedPrecisionModifier(average_bits=4.5)])


def test_gptq_takes_the_choice_of_the_mixed_precision_modifier_before_it():
    recipe = Recipe.from_any({"quant_stage": {"MixedPrecisionModifier": {"size": "3MB", "ignore": ["lm_head"]}, "GPTQModifier": {"block_size": 64}}})
    [modifier] = recipe.modifiers
    assert isinstance(modifier, GPTQModifier) and modifier.config.mixed_precision.size == "3MB"
    assert modifier.config.ignore == ["lm_head"] and modifier.config.block_size == 64


def test_awq_searches_each_mapping_against_the_scheme_chosen_for_it():
    from llmpress.lifecycle.state import scheme_of
    from llmpress.modifiers import AWQModifier

    batches = [torch.tensor(b) for b in token_batches(4, 32)]
    choice = {"average_bits": 5.5, "schemes": ["W4A16_G32", "W8A16"], "ignore": ["lm_head"]}
    alone = llmpress.oneshot(make_tiny_llama(), [MixedPrecisionModifier(**choice)], batches)
    smoothed = llmpress.oneshot(make_tiny_llama(), [AWQModifier(), MixedPrecisionModifier(**choice)], batches)
    bits = {scheme_of(m).weights.num_bits for m in smoothed.modules() if scheme_of(m) is not None}
    assert bits == {4, 8}
    ids = torch.tensor([token_batches(1, 24, seed=3)[0]])
    assert not torch.equal(logits(alone, ids), logits(smoothed, ids))  # AWQ moved the scales before the rounding


def test_a_layer_called_with_arguments_of_its_own_is_weighed_on_its_own_inputs():
    """Gemma 3's global layer takes its own rotary tables and mask: weighed block by block, its
    o_proj sees what the whole model gives it (the first layer's arguments would give another)."""
    from architectures import SMALL
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma3_text", **{**SMALL, "head_dim": 32, "num_hidden_layers": 6})).eval()
    assert model.config.layer_types[-1] == "full_attention"
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    rows = [torch.tensor(b) for b in token_batches(2, 16, vocab=4096)]
    options = MixedPrecision(average_bits=5, schemes=["W4A16_G32", DENSE]).options()
    measured = measure(model, modules, rows, options)
    name = "model.layers.5.self_attn.o_proj"
    seen = []
    hook = modules[name].register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for row in rows:
            model(input_ids=row[None])
    hook.remove()
    inputs = torch.cat(seen).double()
    weight = modules[name].weight.detach()
    error = (round_to_nearest(weight, None, options[0].scheme) - weight).double()
    expected = 0.5 * float((measured.output_grads[name] / measured.tokens * ((error @ (inputs.t() @ inputs)) * error).sum(1)).sum())
    assert measured.costs[name][0] == pytest.approx(expected, rel=1e-5)
