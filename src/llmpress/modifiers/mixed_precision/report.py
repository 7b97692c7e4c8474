"""What a mixed-precision choice chose, and why, from its record in a checkpoint's config: a
table by layer (``llmpress inspect``) and a plot (``llmpress inspect --plot``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from llmpress.errors import MissingDependencyError
from llmpress.quant.groups import EXPERT_NAME

__all__ = ["choice_rows", "choice_summary", "plot_choice"]

_LAYER = re.compile(r"\.(\d+)\.")


def _kind(modules: list[str]) -> str:
    """A group's short name: its modules' last names without ``_proj`` (``q/k/v``, ``gate/up``),
    or ``experts`` for an experts block."""
    if any(EXPERT_NAME.fullmatch(m) for m in modules):
        return "experts"
    names = dict.fromkeys(m.rpartition(".")[2].removesuffix("_proj") or m for m in modules)
    return "/".join(names)


def choice_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per group: its layer (None outside the numbered layers, or where the group spans
    several: an MoE's experts under one scheme), the layers it spans, kind, choice, bits per
    weight, and the sensitivity of each option, in the record's order."""
    rows = []
    for group in record.get("groups", []):
        layers = sorted({int(found.group(1)) for m in group["modules"] if (found := _LAYER.search(m))})
        weights = max(int(group.get("weights") or 0), 1)
        chosen = record["menu"].index(group["chosen"])
        rows.append({"layer": layers[0] if len(layers) == 1 else None, "layers": layers, "kind": _kind(group["modules"]),
                     "chosen": group["chosen"], "bits_per_weight": group["bits"][chosen] / weights,
                     "sensitivity": group["sensitivity"], "modules": group["modules"]})
    return rows


def choice_summary(record: dict[str, Any]) -> list[str]:
    """Lines for ``llmpress inspect``: the target, then a table of layers by group kind."""
    target = record.get("target", {})
    wanted = f"{target['average_bits']} bits per weight" if "average_bits" in target else f"a size of {target.get('size')}"
    lines = [f"mixed precision: {record.get('average_bits')} bits per weight on average (target {wanted}), "
             f"chosen from {', '.join(record.get('menu', []))} by {record.get('measure', 'sensitivity')} "
             f"on {record.get('samples')} sequences"]
    rows = choice_rows(record)
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    table: dict[Any, dict[str, str]] = {}
    for row in rows:
        for layer in row["layers"] or [None]:
            table.setdefault(layer, {})[row["kind"]] = row["chosen"]
    width = max([len(k) for k in kinds] + [len(c) for cells in table.values() for c in cells.values()] + [5])
    lines.append("    layer  " + "  ".join(k.ljust(width) for k in kinds))
    for layer, cells in table.items():
        label = "-" if layer is None else str(layer)
        lines.append(f"    {label:>5}  " + "  ".join(cells.get(k, "").ljust(width) for k in kinds))
    return lines


def plot_choice(record: dict[str, Any], png: str | Path) -> Path:
    """A PNG: above, the bits per weight chosen for each group kind by layer; below, each
    kind's sensitivity at the menu's cheapest scheme (what the choice weighed), log scale; a
    group spanning layers (an MoE's experts under one scheme) above only."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise MissingDependencyError("--plot needs matplotlib", fix="pip install matplotlib  (or 'llmpress[plot]')") from None
    rows = [r for r in choice_rows(record) if r["layers"]]
    cheapest = _cheapest(record)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        line, = top.plot([n for r in mine for n in r["layers"]], [r["bits_per_weight"] for r in mine for _ in r["layers"]], marker="o",
                         label=kind)
        own = [r for r in mine if r["layer"] is not None]
        bottom.plot([r["layer"] for r in own], [max(r["sensitivity"][cheapest], 1e-12) for r in own], marker=".", label=kind,
                    color=line.get_color())
    top.axhline(record.get("average_bits", 0), color="grey", linestyle="--", linewidth=1, label="average")
    top.set_ylabel("bits per weight chosen")
    top.legend(fontsize=8, ncol=4)
    bottom.set_yscale("log")
    bottom.set_ylabel(f"sensitivity at {record['menu'][cheapest]}")
    bottom.set_xlabel("layer")
    bottom.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    figure.suptitle(f"mixed precision: {record.get('average_bits')} bits per weight")
    figure.tight_layout()
    path = Path(png)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _cheapest(record: dict[str, Any]) -> int:
    """The menu option with the fewest bits in the record's first group."""
    bits = record["groups"][0]["bits"]
    return min(range(len(bits)), key=bits.__getitem__)
