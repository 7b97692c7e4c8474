"""Recipes: every way of building one, llm-compressor's grammar, clear errors, YAML round trip."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from llmpress import Recipe
from llmpress.errors import RecipeError
from llmpress.modifiers import QuantizationModifier
from llmpress.quant import PRESET_SCHEMES

LLM_COMPRESSOR_RECIPE = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          weights:
            num_bits: 4
            type: "int"
            symmetric: true
            strategy: "group"
            group_size: 128
          input_activations: null
          output_activations: null
          targets: ["Linear"]
"""


def test_llm_compressor_grammar_reads_unchanged():
    recipe = Recipe.from_any(LLM_COMPRESSOR_RECIPE)
    assert [s.name for s in recipe.stages] == ["quant_stage"]
    (modifier,) = recipe.modifiers
    assert isinstance(modifier, QuantizationModifier)
    (scheme,) = modifier.config.resolved_schemes()
    assert scheme.weights.num_bits == 4 and scheme.weights.group_size == 128
    assert modifier.config.ignore == ["lm_head"]


def test_top_level_modifiers_form_a_default_stage():
    recipe = Recipe.from_any({"QuantizationModifier": {"scheme": "W8A8"}})
    assert recipe.modifiers == [QuantizationModifier(scheme="W8A8")]


def test_from_preset_modifier_and_list_agree():
    by_preset = Recipe.from_any("w4a16")
    (modifier,) = by_preset.modifiers
    assert modifier == QuantizationModifier(scheme="W4A16", ignore=["lm_head"])
    assert Recipe.from_any(modifier).modifiers == Recipe.from_any([modifier]).modifiers


def test_unknown_modifier_lists_known_and_suggests():
    with pytest.raises(RecipeError) as info:
        Recipe.from_any({"quant_stage": {"quant_modifiers": {"QuantizationModifer": {"scheme": "W4A16"}}}})
    text = str(info.value)
    assert "QuantizationModifer" in text and "QuantizationModifier" in text and "did you mean" in text


def test_unknown_field_names_the_offender_and_known_fields():
    with pytest.raises(RecipeError) as info:
        QuantizationModifier(schem="W4A16")
    text = str(info.value)
    assert "'schem'" in text and "scheme" in text and "did you mean 'scheme'" in text


def test_scheme_and_config_groups_are_exclusive():
    with pytest.raises(RecipeError, match="exactly one of"):
        QuantizationModifier()
    with pytest.raises(RecipeError, match="scheme and config_groups"):
        QuantizationModifier(scheme="W4A16", config_groups={"g": {"weights": {"num_bits": 4}}})
    with pytest.raises(RecipeError, match="scheme and mixed_precision"):
        QuantizationModifier(scheme="W4A16", mixed_precision={"average_bits": 4})


def test_bad_grammar_is_a_recipe_error():
    with pytest.raises(RecipeError, match="top-level"):
        Recipe.from_any({"quantization": {"QuantizationModifier": {"scheme": "W4A16"}}})
    with pytest.raises(RecipeError, match="not valid YAML"):
        Recipe.from_yaml("quant_stage: [unclosed")
    with pytest.raises(RecipeError, match="mapping"):
        Recipe.from_yaml("W4A17")
    with pytest.raises(RecipeError, match="No such file"):
        Recipe.from_any("missing/recipe.yaml")


@pytest.mark.parametrize(
    "source",
    [*PRESET_SCHEMES, LLM_COMPRESSOR_RECIPE, {"s1_stage": {"a_modifiers": {"QuantizationModifier": {"scheme": {"W4A16": ["re:.*mlp.*"], "W8A8": ["re:.*attn.*"]}}}}}],
)
def test_yaml_round_trip_is_plain_and_equal(source):
    recipe = Recipe.from_any(source)
    text = recipe.to_yaml()
    assert "!!" not in text
    data = yaml.safe_load(text)
    assert Recipe.from_dict(data) == recipe
    assert Recipe.from_yaml(json.dumps(data)) == recipe  # JSON reads the same


def test_recipe_files(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(LLM_COMPRESSOR_RECIPE)
    assert Recipe.from_any(str(path)) == Recipe.from_any(LLM_COMPRESSOR_RECIPE)
    json_path = tmp_path / "r.json"
    json_path.write_text(json.dumps(Recipe.from_any("W8A8").to_dict()))
    assert Recipe.from_any(json_path) == Recipe.from_any("W8A8")


def test_adding_recipes_keeps_every_stage():
    combined = Recipe.from_any("W4A16") + Recipe.from_any("W8A8")
    assert [s.name for s in combined.stages] == ["quant_stage", "quant_1_stage"]
    assert Recipe.from_dict(yaml.safe_load(combined.to_yaml())) == combined


LLMCOMPRESSOR_GPTQ_RECIPE = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}
    GPTQModifier:
      block_size: 64
      dampening_frac: 0.02
"""


def test_gptq_without_a_scheme_quantizes_what_the_stage_describes():
    """llm-compressor's recipes give the scheme to a QuantizationModifier and the algorithm to a
    GPTQModifier with only block_size: the two become one GPTQ over that scheme."""
    from llmpress.modifiers import GPTQModifier

    (modifier,) = Recipe.from_yaml(LLMCOMPRESSOR_GPTQ_RECIPE).modifiers
    assert isinstance(modifier, GPTQModifier)
    assert modifier.config.block_size == 64 and modifier.config.dampening_frac == 0.02
    assert modifier.config.ignore == ["lm_head"]
    (scheme,) = modifier.config.resolved_schemes()
    assert scheme.weights.num_bits == 4 and scheme.weights.group_size == 128
    with pytest.raises(RecipeError, match="GPTQModifier has no scheme, and no QuantizationModifier before it"):
        Recipe.from_yaml("quant_stage:\n  GPTQModifier: {block_size: 64}\n")


def test_recipe_file_needs_no_suffix_and_may_be_a_pipe(tmp_path):
    import os

    plain = tmp_path / "recipe"
    plain.write_text(LLMCOMPRESSOR_GPTQ_RECIPE)
    assert Recipe.from_any(str(plain)) == Recipe.from_yaml(LLMCOMPRESSOR_GPTQ_RECIPE)
    read, write = os.pipe()
    os.write(write, LLMCOMPRESSOR_GPTQ_RECIPE.encode())
    os.close(write)
    try:
        assert Recipe.from_any(f"/dev/fd/{read}") == Recipe.from_yaml(LLMCOMPRESSOR_GPTQ_RECIPE)
    finally:
        os.close(read)
    with pytest.raises(RecipeError, match="cannot read the recipe file"):
        Recipe.from_file(tmp_path)


def test_saved_recipes_are_what_llm_compressor_reads():
    """compressed-tensors requires each config group's ``targets``, even the default one; lists
    of names sit on one line; AWQ's mappings keep AWQ's form, SmoothQuant's its own."""
    from llmpress.modifiers import AWQModifier, QuantizationModifier, SmoothQuantModifier

    groups = {"group_0": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 128}}}
    mappings = [[["re:.*q_proj$", "re:.*k_proj$"], "re:.*input_layernorm$"]]
    recipe = Recipe.from_any([AWQModifier(mappings=mappings), SmoothQuantModifier(mappings=mappings),
                              QuantizationModifier(config_groups=groups, ignore=["lm_head"])])
    text = recipe.to_yaml()
    data = yaml.safe_load(text)["default_stage"]["default_modifiers"]
    assert data["QuantizationModifier"]["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert "ignore: [lm_head]" in text
    assert data["AWQModifier"]["mappings"] == [{"smooth_layer": "re:.*input_layernorm$", "balance_layers": ["re:.*q_proj$", "re:.*k_proj$"]}]
    assert data["SmoothQuantModifier"]["mappings"] == mappings
    assert Recipe.from_yaml(text) == recipe


def test_every_compressed_tensors_preset_name_reads():
    """llm-compressor's recipes may name any of compressed-tensors' presets (0.19 and 0.20):
    each one llmpress writes is a preset here with compressed-tensors' fields; the rest are
    refused by name, with the reason."""
    ct = pytest.importorskip("compressed_tensors.quantization.quant_scheme")
    from llmpress.quant.presets import NOT_WRITTEN, preset_scheme

    assert set(ct.PRESET_SCHEMES) <= set(PRESET_SCHEMES) | set(NOT_WRITTEN)
    for name in ct.PRESET_SCHEMES:
        if name in NOT_WRITTEN:
            with pytest.raises(RecipeError, match="does not write"):
                QuantizationModifier(scheme=name)
            continue
        ours = preset_scheme(name).model_dump(mode="json")
        for field in ("weights", "input_activations"):
            args, mine = ct.PRESET_SCHEMES[name].get(field), ours[field]
            assert (args is None) == (mine is None), (name, field)
            theirs = {} if args is None else args.model_dump(mode="json")
            for key in ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic", "scale_dtype"):
                assert args is None or theirs.get(key) == mine[key], (name, field, key, theirs.get(key), mine[key])


def test_spelled_groups_are_config_groups_in_the_recipe():
    """``W4A16_G32`` (a preset's int weights in groups of 32) runs from a name, and the recipe
    writes the config group it means: llm-compressor knows only the presets' names."""
    recipe = Recipe.from_any("w4a16_g32")
    modifier = recipe.modifiers[0]
    assert modifier.config.scheme is None and list(modifier.config.config_groups) == ["group_0"]
    weights = modifier.config.config_groups["group_0"].weights
    assert (weights.num_bits, weights.group_size, weights.symmetric) == (4, 32, True)
    assert "W4A16_G32" not in recipe.to_yaml() and Recipe.from_yaml(recipe.to_yaml()) == recipe
    mixed = QuantizationModifier(scheme={"W3A16_ASYM_G64": ["re:.*mlp.*"], "W8A8": "re:.*attn.*"})
    first, second = mixed.config.config_groups.values()
    assert (first.weights.num_bits, first.weights.group_size, first.weights.symmetric, first.targets) == (3, 64, False, ["re:.*mlp.*"])
    assert second.input_activations.num_bits == 8 and second.targets == ["re:.*attn.*"]
    assert QuantizationModifier(scheme="W4A8").config.scheme == "W4A8"  # compressed-tensors' own names stay names


@pytest.mark.parametrize("name, words", [("W4A16_G0", "group size 0"), ("FP8_G64", "not int in groups"),
                                         ("W8A8_G128", "not int in groups"), ("W4A17", "did you mean 'W4A16'"),
                                         ("MXFP6A16", "does not write"), ("unquantized", "quantizes nothing")])
def test_names_that_mean_nothing_are_refused(name, words):
    with pytest.raises(RecipeError, match=words):
        Recipe.from_any(name)


def test_observer_overrides_are_llm_compressor_s():
    """``weight_observer`` / ``input_observer`` / ``observer: {weights, input}`` (llm-compressor
    0.14) set the observer of every scheme the modifier resolves, the mixed-precision ones too;
    an input range is min/max, so an MSE input observer is refused, as are both forms at once."""
    from llmpress.modifiers import GPTQModifier

    assert GPTQModifier(scheme="W4A16", weight_observer="minmax").config.resolved_schemes()[0].weights.observer == "minmax"
    fp8 = QuantizationModifier(scheme="FP8", observer={"weights": "MSE", "input": "static_minmax"}).config.resolved_schemes()[0]
    assert (fp8.weights.observer, fp8.input_activations.observer) == ("mse", "static_minmax")
    grouped = QuantizationModifier(config_groups={"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "channel"}}},
                                   weight_observer="mse")
    assert grouped.config.resolved_schemes()[0].weights.observer == "mse"
    assert "weight_observer: mse" in Recipe.from_any(grouped).to_yaml()
    for fields, words in [({"input_observer": "mse"}, "minimum and maximum"), ({"weight_observer": "nosuch"}, "unknown observer"),
                          ({"observer": {"weight": "mse"}}, "unknown keys"),
                          ({"weight_observer": "mse", "observer": {"weights": "mse"}}, "not both")]:
        with pytest.raises(RecipeError, match=words):
            QuantizationModifier(scheme="FP8", **fields)


def test_weight_observer_override_rounds_as_the_scheme_s_own(tmp_path):
    """An override is the same as writing the observer into the scheme."""
    from helpers import make_tiny_llama

    import llmpress

    weights = {"num_bits": 4, "strategy": "group", "group_size": 64}
    outputs = {}
    for name, modifier in [("override", QuantizationModifier(config_groups={"g": {"targets": ["Linear"], "weights": weights}},
                                                             weight_observer="mse", ignore=["lm_head"])),
                           ("scheme", QuantizationModifier(config_groups={"g": {"targets": ["Linear"], "weights": {**weights, "observer": "mse"}}},
                                                           ignore=["lm_head"])),
                           ("default", QuantizationModifier(config_groups={"g": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"]))]:
        model = llmpress.oneshot(make_tiny_llama(), modifier)
        outputs[name] = model.model.layers[0].mlp.down_proj.weight_scale.clone()
    assert torch.equal(outputs["override"], outputs["scheme"]) and not torch.equal(outputs["override"], outputs["default"])


def test_magnitude_pruning_reads_llm_compressor_s_schedule_fields():
    from llmpress.modifiers import MagnitudePruningModifier
    from llmpress.modifiers.pruning.magnitude import scheduled_sparsity

    old = MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.5, end=1, update_frequency=0.25)
    assert old.config.update == 0.25 and "update: 0.25" in Recipe.from_any(old).to_yaml()  # written as llm-compressor's field
    expected = {"cubic": [0.1, 0.33125, 0.45, 0.5], "linear": [0.1, 0.2, 0.3, 0.5], "polynomial_decay": [0.1, 0.275, 0.4, 0.5],
                "polynomial": [0.1, 0.125, 0.2, 0.5], "multi_step": [0.1, 0.3, 0.3, 0.45]}
    args = {"multi_step": {"steps": [[0.2, 0.3], [0.6, 0.45]]}}
    for scheduler, values in expected.items():
        config = MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.5, end=1, update_scheduler=scheduler,
                                          scheduler_args=args.get(scheduler, {})).config
        assert [scheduled_sparsity(config, p, p) for p in (0, 0.25, 0.5, 1.0)] == pytest.approx(values), scheduler
    for fields in ({"update_scheduler": "exponential"}, {"apply_globally": True}):
        with pytest.raises(RecipeError):
            MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.5, end=1, **fields)


def test_saved_recipes_carry_what_llm_compressor_requires():
    """llm-compressor 0.14 requires ``targets`` and both sparsities of MagnitudePruningModifier,
    ``targets`` of ConstantPruningModifier and ``sparsity`` of SparseGPT / Wanda, and defaults
    ``leave_enabled`` to False: written even where llmpress's defaults would leave them out."""
    from llmpress.modifiers import ConstantPruningModifier, MagnitudePruningModifier, SparseGPTModifier

    recipe = Recipe.from_any([SparseGPTModifier(mask_structure="2:4"), MagnitudePruningModifier(final_sparsity=0.5, end=1),
                              ConstantPruningModifier(start=1, end=2)])
    data = yaml.safe_load(recipe.to_yaml())["default_stage"]["default_modifiers"]
    assert data["SparseGPTModifier"]["sparsity"] == 0.5
    assert {k: data["MagnitudePruningModifier"][k] for k in ("targets", "init_sparsity", "final_sparsity", "leave_enabled")} == \
        {"targets": ["Linear"], "init_sparsity": 0.0, "final_sparsity": 0.5, "leave_enabled": True}
    assert data["ConstantPruningModifier"]["targets"] == ["Linear"]
    assert Recipe.from_yaml(recipe.to_yaml()).to_yaml() == recipe.to_yaml()
