"""Recipes are read bounded and strict: a small file whose YAML aliases expand to billions of
values, a huge file, a key given twice are refused with a RecipeError before anything walks them
(issue 42, group 5), also as the recipe.yaml of a model folder."""

from __future__ import annotations

import resource

import pytest
from helpers import make_tiny_llama

import llmpress
from llmpress.errors import RecipeError
from llmpress.recipe import Recipe


def billion_laughs(nesting: int = 9) -> str:
    """Ten times ten ... times ten values from a file of under a kilobyte, inside observer_kwargs."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, nesting + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    lines += ["quant_stage:", "  quant_modifiers:", "    QuantizationModifier:", "      scheme: W4A16",
              f"      observer_kwargs: {{laughs: *a{nesting}}}"]
    return "\n".join(lines) + "\n"


def test_aliases_that_expand_without_bound_are_refused_at_once():
    text = billion_laughs()
    assert len(text) < 1024
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(RecipeError, match="too many values through its YAML aliases"):
        Recipe.from_yaml(text)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KB: nothing was expanded


def test_a_few_aliases_still_read():
    text = ("quant_stage:\n  quant_modifiers:\n"
            "    QuantizationModifier: {targets: &linear [Linear], scheme: W4A16, ignore: *linear}\n")
    assert "ignore: [Linear]" in Recipe.from_yaml(text).to_yaml()


def test_a_key_given_twice_is_refused_with_its_line():
    text = ("quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {scheme: W4A16}\n"
            "    QuantizationModifier: {scheme: W8A8}\n")
    with pytest.raises(RecipeError, match=r"same key twice.*line 4"):
        Recipe.from_yaml(text)


def test_a_huge_recipe_file_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "recipe.yaml"
    with open(path, "w") as handle:
        handle.write("quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {scheme: W4A16}\n")
        handle.write("# padding\n" * 200_000)
    with pytest.raises(RecipeError, match="too large for a recipe"):
        Recipe.from_file(path)


def test_a_model_folder_whose_recipe_laughs_loads_without_it(tmp_path, caplog):
    """The folder's recipe.yaml is a record of how it was made, not needed to load it: the model
    loads at once, with a warning that the record is not carried (it used to stall the run)."""
    folder = tmp_path / "tiny"
    make_tiny_llama().save_pretrained(folder)
    (folder / "recipe.yaml").write_text(billion_laughs())
    llmpress.oneshot(str(folder), "W8A16", output_dir=tmp_path / "out", model_free=False, return_model=False)
    assert "YAML aliases" in caplog.text
    assert "laughs" not in (tmp_path / "out" / "recipe.yaml").read_text()


def test_merge_keys_still_read_and_may_be_overridden():
    text = ("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      config_groups:\n"
            "        group_0:\n          targets: [Linear]\n"
            "          weights: &w {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}\n"
            "        group_1:\n          targets: ['re:.*down_proj']\n          weights: {<<: *w, group_size: 64}\n")
    written = Recipe.from_yaml(text).to_yaml()
    assert "group_size: 64" in written and "group_size: 128" in written


def test_deep_nesting_is_a_recipe_error():
    with pytest.raises(RecipeError, match="nests too deeply|not valid YAML"):
        Recipe.from_yaml("a_stage: " + "[" * 3000 + "]" * 3000)
