"""Recipes: every way of building one, llm-compressor's grammar, clear errors, YAML round trip."""

from __future__ import annotations

import json

import pytest
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
