"""What AutoRound did, kept in the model's config (``config.json`` key ``llmpress_autoround``)
and told by ``llmpress inspect``: each tuned layer's block loss before and after tuning."""

from __future__ import annotations

from typing import Any

from llmpress.lifecycle.records import config_entry

__all__ = ["RECORD_KEY", "autoround_record", "record_of", "record_summary"]

RECORD_KEY = "llmpress_autoround"


def autoround_record(iters: int, batch_size: int, losses: dict[int, tuple[float, float, int]]) -> dict[str, Any]:
    """``losses``: per layer, the block loss of the untuned rounding (round-to-nearest over the
    min/max range; symmetric integers on the whole grid), the best one, and its step."""
    return {"iters": iters, "batch_size": batch_size,
            "layers": [[index, rtn, best, step] for index, (rtn, best, step) in sorted(losses.items())]}


def record_of(config: Any) -> dict[str, Any] | None:
    """The AutoRound record of a model config (an object or a config.json dict), if any."""
    record = config_entry(config, RECORD_KEY)
    return record if record and record.get("layers") else None


def record_summary(record: dict[str, Any]) -> list[str]:
    """A few lines for ``llmpress inspect``: the tuning, and the block loss it cut per layer."""
    layers = record["layers"]
    cuts = [1 - best / rtn for _, rtn, best, _ in layers if rtn > 0]
    lines = [f"AutoRound: {len(layers)} layer(s), {record['iters']} steps of {record['batch_size']} samples each; "
             f"the block loss {100 * sum(cuts) / max(len(cuts), 1):.0f}% below the untuned rounding's on average"]
    shown = layers if len(layers) <= 8 else [*layers[:4], *layers[-4:]]
    lines += [f"  layer {index}: {rtn:.3g} -> {best:.3g} (step {step})" for index, rtn, best, step in shown]
    if len(shown) < len(layers):
        lines.insert(5, f"  ... {len(layers) - len(shown)} more")
    return lines
