"""The package is a stack of floors (``docs/architecture.md``, its ``floors`` block): imports run
down or within a folder, never up or sideways; no import cycle between files; no ``llmpress``
import hidden inside a function outside the command line (and ``oneshot``'s model loader)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest
from helpers import REPO

PACKAGE = REPO / "src" / "llmpress"
#: the imports made lazily on purpose, by module (None: any): ``llmpress --help`` answers before
#: torch is imported; ``oneshot`` imports the model loader (and transformers with it) only when it
#: reads a model, so a model-free run never imports transformers; GPTQ's Triton kernel is imported
#: when a GPU first runs it (Triton is absent from CPU installs)
LAZY = {"llmpress.cli": None, "llmpress.entrypoints": {"llmpress.loading.loader"},
        "llmpress.native": {"llmpress.native.gptq_triton"}}


def _floors() -> dict[str, int]:
    """Folder (or top-level module) -> floor, from the architecture document."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"```floors\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```floors block"
    floors = {}
    for line in block.group(1).splitlines():
        number, _, *folders = line.split()
        for folder in folders:
            floors[folder] = int(number)
    return floors


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _unit(module: str) -> str:
    """The folder (or top-level module) a module belongs to: ``llmpress.pipelines.storage.kept`` ->
    ``pipelines``; the package itself is ``llmpress``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "llmpress"


class _Imports(ast.NodeVisitor):
    """Every ``llmpress`` import of one module: (imported module, line, inside a function)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.found: list[tuple[str, int, bool]] = []
        self.depth = 0

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return  # type names only: never executed
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "llmpress":
                self.found.append((alias.name, node.lineno, self.depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.module.split(".")[: len(self.module.split(".")) - (0 if self.is_package else 1)]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        if base.split(".")[0] != "llmpress":
            return
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self.found.append((submodule if submodule in MODULES else base, node.lineno, self.depth > 0))


def _imports() -> dict[str, list[tuple[str, int, bool]]]:
    out = {}
    for module, path in MODULES.items():
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        out[module] = visitor.found
    return out


IMPORTS = _imports()


def test_every_folder_has_a_floor():
    floors = _floors()
    missing = sorted({_unit(m) for m in MODULES} - set(floors))
    assert not missing, f"add these to the floors block of docs/architecture.md: {missing}"
    stale = sorted(set(floors) - {_unit(m) for m in MODULES})
    assert not stale, f"docs/architecture.md names folders the package does not have: {stale}"


def test_imports_run_down_the_floors():
    floors = _floors()
    wrong = []
    for module, imports in IMPORTS.items():
        home = _unit(module)
        for target, line, _ in imports:
            there = _unit(target)
            if there != home and floors[there] >= floors[home]:
                way = "sideways" if floors[there] == floors[home] else "up"
                wrong.append(f"{module}:{line} imports {target} ({way}: {home} is on floor {floors[home]}, {there} on {floors[there]})")
    assert not wrong, "\n".join(wrong)


def test_no_import_hides_in_a_function():
    hidden = [f"{module}:{line} imports {target} inside a function"
              for module, imports in IMPORTS.items() if not (module in LAZY and LAZY[module] is None)
              for target, line, inside in imports if inside and target not in LAZY.get(module, ())]
    assert not hidden, "\n".join(hidden)


def test_no_import_cycle_between_files():
    graph = defaultdict(set)
    for module, imports in IMPORTS.items():
        for target, _, _ in imports:
            if target != module and target in MODULES:
                graph[module].add(target)
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", ["pipelines", "pipelines.by_module", "pipelines.storage"])
def test_the_pipeline_files_stay_readable(package):
    """Each file of the pipeline folder is read on its own: at most 250 lines."""
    folder = PACKAGE.joinpath(*package.split("."))
    long = {p.name: n for p in folder.glob("*.py") if (n := len(p.read_text().splitlines())) > 250}
    assert not long, f"over 250 lines in {package}: {long}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """A module of a low floor importing a high one is caught (the checker is not blind)."""
    floors = _floors()
    visitor = _Imports("llmpress.quant.fake", is_package=False)
    visitor.visit(ast.parse("from llmpress.session import Session\n\ndef f():\n    from llmpress.recipe import Recipe\n"))
    (target, _, inside), (lazy, _, lazy_inside) = visitor.found
    assert floors[_unit(target)] > floors["quant"] and not inside
    assert _unit(lazy) == "recipe" and lazy_inside
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
