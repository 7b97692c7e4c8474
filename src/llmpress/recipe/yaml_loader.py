"""The YAML reader of recipes: safe, bounded, strict.

``yaml.safe_load`` never runs code, but it will build what a small file asks for: a recipe of
a kilobyte whose aliases refer to aliases ("billion laughs") expands to billions of values as
soon as anything walks it, and a repeated key silently keeps its last value. ``load_recipe_yaml``
refuses both before anything reads the result: a text over 1 MB, a document that expands to more
than 100,000 values, a key given twice in one mapping. It also reads the ``!!python/...`` tags
llm-compressor writes for enum values (``!!python/object/apply:...ActivationOrdering [static]``)
as their plain value; nothing is ever imported or constructed from a tag.
"""

from __future__ import annotations

from typing import Any

import yaml

from llmpress.errors import RecipeError

__all__ = ["MAX_RECIPE_BYTES", "MAX_RECIPE_VALUES", "load_recipe_yaml"]

MAX_RECIPE_BYTES = 1 << 20
MAX_RECIPE_VALUES = 100_000


def load_recipe_yaml(text: str, origin: str = "recipe") -> Any:
    if len(text) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{origin} is too large for a recipe", got=f"{len(text)} characters",
                          expected=f"at most {MAX_RECIPE_BYTES} (recipes are a few kilobytes)")
    try:
        loader = _RecipeLoader(text)
    except yaml.YAMLError as exc:  # the reader refuses control characters at once
        raise RecipeError(f"{origin} is not valid YAML or JSON", got=" ".join(str(exc).split())[:300]) from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        values = _expanded_size(node, {})
        if values > MAX_RECIPE_VALUES:
            raise RecipeError(f"{origin} expands to too many values through its YAML aliases", got=f"more than {MAX_RECIPE_VALUES} values",
                              expected=f"at most {MAX_RECIPE_VALUES}", fix="write the values out instead of nesting aliases")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{origin} is not valid YAML or JSON", got=" ".join(str(exc).split())[:300]) from None
    except RecursionError:
        raise RecipeError(f"{origin} nests too deeply", expected="a recipe a few levels deep") from None
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values ``node`` stands for once every alias is replaced by what it names (each
    shared node counted once per reference, computed once)."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(key, sizes) + _expanded_size(value, sizes) for key, value in node.value)
    sizes[id(node)] = min(size, MAX_RECIPE_VALUES + 1)  # bounded: the sums of a deep nesting stay small integers
    return sizes[id(node)]


class _RecipeLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise RecipeError("a recipe gives the same key twice in one mapping", got=f"{key!r} (line {key_node.start_mark.line + 1})",
                                      expected="each key once", fix="keep the one you mean")
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _plain_value(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.ScalarNode):
        return loader.construct_scalar(node)
    if isinstance(node, yaml.SequenceNode):
        values = loader.construct_sequence(node, deep=True)
        return values[0] if len(values) == 1 else values
    return loader.construct_mapping(node, deep=True)


_RecipeLoader.add_multi_constructor("tag:yaml.org,2002:python/", _plain_value)
