"""The command line: oneshot, eval, inspect, and one clear line for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import text_path, trained_model_dir

from llmpress.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmpress", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def w4a16_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "w4a16"
    code = main(["oneshot", "--model", str(trained_model_dir()), "--recipe", "W4A16", "--output", str(out),
                 "--dataset", str(text_path("calibration.txt")), "--num-samples", "8", "--seq-len", "128"])
    assert code == 0
    return out


def test_oneshot_writes_a_complete_checkpoint(w4a16_checkpoint):
    names = {p.name for p in w4a16_checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "recipe.yaml", "tokenizer.json"} <= names


def test_eval_json_and_plot(w4a16_checkpoint, tmp_path, capsys):
    png = tmp_path / "ppl.png"
    code = main(["eval", "--model", str(w4a16_checkpoint), "--dataset", str(text_path("evaluation.txt")),
                 "--max-windows", "4", "--json", "--plot", str(png)])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 4 * 255 and 1 < result["perplexity"] < 500
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_inspect(w4a16_checkpoint, capsys):
    assert main(["inspect", str(w4a16_checkpoint)]) == 0
    text = capsys.readouterr().out
    assert "pack-quantized" in text and "int4 sym group(128) weights" in text and "28 module(s)" in text
    assert main(["inspect", "--json", str(w4a16_checkpoint)]) == 0
    assert json.loads(capsys.readouterr().out)["groups"][0]["modules"] == 28


@pytest.mark.parametrize(
    "args, words",
    [
        (["oneshot", "--model", "no/such/model", "--recipe", "W4A16", "--output", "x"], "model folder not found"),
        (["oneshot", "--model", "MODEL", "--recipe", "W4A17", "--output", "x"], "must be a mapping"),
        (["oneshot", "--model", "MODEL", "--recipe", "broken.yaml", "--output", "x"], "recipe file not found"),
        (["eval", "--model", "MODEL", "--dataset", "no/such.txt"], "evaluation text not found"),
        (["inspect", "no/such/dir"], "not a checkpoint folder"),
    ],
)
def test_bad_input_is_one_clear_line(args, words, tmp_path):
    args = [a.replace("MODEL", str(trained_model_dir())) for a in args]
    args = [str(tmp_path / a) if a in ("x", "broken.yaml") else a for a in args]
    result = run_cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and words in lines[0], result.stderr[-1500:]


def test_broken_recipe_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      scheme: W4A16\n      group: 3\n")
    result = run_cli("oneshot", "--model", str(trained_model_dir()), "--recipe", str(recipe), "--output", str(tmp_path / "o"))
    assert result.returncode == 2 and "unknown field 'group'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()


def test_argparse_errors_exit_non_zero():
    assert run_cli("oneshot", "--model").returncode == 2


@pytest.mark.parametrize("flag, value", [("--seq-len", "1"), ("--batch-size", "0"), ("--max-windows", "zero")])
def test_eval_rejects_bad_numbers(flag, value):
    result = run_cli("eval", "--model", str(trained_model_dir()), "--dataset", str(text_path("evaluation.txt")), flag, value)
    assert result.returncode == 2 and "Traceback" not in result.stderr and flag in result.stderr


def test_generate_from_a_compressed_checkpoint(w4a16_checkpoint, capsys):
    code = main(["generate", "--model", str(w4a16_checkpoint), "--prompt", "The Python", "--max-new-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.startswith("The Python") and len(captured.out) > len("The Python\n")
    assert "8 tokens" in captured.err and "kernels: int4" in captured.err


def test_generate_quantizes_a_full_precision_checkpoint_on_load(capsys):
    code = main(["generate", "--model", str(trained_model_dir()), "--prompt", "def", "--max-new-tokens", "4", "--quantize", "8"])
    assert code == 0 and "kernels: int8" in capsys.readouterr().err


def test_inspect_a_plain_checkpoint(capsys):
    assert main(["inspect", str(trained_model_dir())]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out
