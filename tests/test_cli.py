"""The command line: oneshot, eval, inspect, and one clear line for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import text_path, trained_model_dir

import llmpress
from llmpress.cli import main

pytestmark = pytest.mark.integration  # the trained model through the command


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


def test_eval_kl_ranks_each_model_against_the_first(w4a16_checkpoint, tmp_path, capsys):
    """--kl: the first model's divergence from itself is 0, the 4-bit model's is above 0, and
    the same as kl_divergence measures between the two models directly; the plot has a KL panel."""
    import torch
    from transformers import AutoTokenizer

    import llmpress
    from llmpress.evaluation import evaluation_windows, kl_divergence

    dense = str(trained_model_dir())
    args = ["eval", "--model", dense, "--model", str(w4a16_checkpoint), "--dataset", str(text_path("evaluation.txt")),
            "--max-windows", "3", "--kl"]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    windows = evaluation_windows(text_path("evaluation.txt").read_text(), AutoTokenizer.from_pretrained(dense), 256, 3)
    direct = kl_divergence(llmpress.load(dense, dequantize=True, dtype=torch.float32), llmpress.load(w4a16_checkpoint, dequantize=True,
                                                                                                    dtype=torch.float32), windows, progress=False)
    assert rows[0]["kl_vs_first"] == 0.0 and rows[1]["kl_vs_first"] == pytest.approx(direct, rel=1e-3) and direct > 0
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "KL vs first" in lines[0] and "KL: mean nats per token" in lines[-1]
    pytest.importorskip("matplotlib")
    from llmpress.evaluation.report import plot_results

    heights = [_png_height(plot_results(chosen, tmp_path / f"{len(chosen[0])}.png"))
               for chosen in (rows, [{k: v for k, v in row.items() if k != "kl_vs_first"} for row in rows])]
    assert heights[0] > 1.8 * heights[1]  # a KL panel under the perplexity panel


def _png_height(png) -> int:
    return int.from_bytes(png.read_bytes()[20:24], "big")  # IHDR: width, then height, big-endian


def test_eval_compares_fp_nvfp4_and_mxfp4_in_one_table_and_plot(tmp_path, capsys):
    """The trained model dense, as NVFP4A16 and as MXFP4A16 (RTN needs no data): one table with
    each one's scheme, size and change against the first, and one plot."""
    models = [str(trained_model_dir())]
    for scheme in ("NVFP4A16", "MXFP4A16"):
        models.append(str(tmp_path / scheme))
        assert main(["oneshot", "--model", models[0], "--recipe", scheme, "--output", models[-1]]) == 0
    capsys.readouterr()
    png = tmp_path / "ppl.png"
    args = ["eval", "--dataset", str(text_path("evaluation.txt")), "--max-windows", "4", "--plot", str(png)]
    assert main([*args, *(a for m in models for a in ("--model", m))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "scheme" in lines[0] and "vs first" in lines[0]
    assert "dense" in lines[1] and "+0.00%" in lines[1]  # float32 (shared fixture) or bfloat16 (bundled copy)
    assert "NVFP4A16" in lines[2] and "MXFP4A16" in lines[3]
    sizes = [float(line.split()[-3]) for line in lines[1:4]]  # model, scheme (words), MB, perplexity, change
    on_disk = [sum(f.stat().st_size for f in Path(m).glob("*.safetensors")) / 2**20 for m in models]
    assert sizes == pytest.approx(on_disk, abs=0.05)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_inspect(w4a16_checkpoint, capsys):
    assert main(["inspect", str(w4a16_checkpoint)]) == 0
    text = capsys.readouterr().out
    assert "pack-quantized" in text and "int4 sym group(128) weights" in text and "28 module(s)" in text
    assert "on this CPU (llmpress.load): int4 (" in text  # the path each module would run on, nothing falls back
    assert main(["inspect", "--json", str(w4a16_checkpoint)]) == 0
    group = json.loads(capsys.readouterr().out)["groups"][0]
    assert group["modules"] == 28 and sum(group["cpu_paths"].values()) == 28 and "dequant" not in group["cpu_paths"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["oneshot", "--model", "no/such/model", "--recipe", "W4A16", "--output", "x"], "not a model checkpoint folder"),
        (["oneshot", "--model", "MODEL", "--recipe", "W4A17", "--output", "x"], "did you mean 'W4A16'"),
        (["oneshot", "--model", "MODEL", "--recipe", "broken.yaml", "--output", "x"], "cannot read the recipe file"),
        (["eval", "--model", "MODEL", "--dataset", "no/such.txt"], "evaluation text not found"),
        (["eval", "--model", "MODEL", "--tasks", "arc_easy", "--kl"], "KL divergence is measured on the perplexity text"),
        (["inspect", "no/such/dir"], "not a checkpoint folder"),
    ],
)
def test_bad_input_is_one_clear_line(args, words, tmp_path, capsys):
    args = [a.replace("MODEL", str(trained_model_dir())) for a in args]
    args = [str(tmp_path / a) if a in ("x", "broken.yaml") else a for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in err, err[-1500:]


def test_the_command_prints_one_line_and_exits_2():
    """The installed entry point, in a process of its own: status, one line, no traceback."""
    result = subprocess.run([sys.executable, "-m", "llmpress", "inspect", "no/such/dir"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        line for line in result.stderr.splitlines() if line.startswith("error:") and "not a checkpoint folder" in line]


def test_broken_recipe_file(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      scheme: W4A16\n      group: 3\n")
    assert main(["oneshot", "--model", str(trained_model_dir()), "--recipe", str(recipe), "--output", str(tmp_path / "o")]) == 2
    assert "unknown field 'group'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args", [["oneshot", "--model"], ["eval", "--model", "M", "--dataset", "D", "--seq-len", "1"],
                                  ["eval", "--model", "M", "--dataset", "D", "--batch-size", "0"],
                                  ["eval", "--model", "M", "--dataset", "D", "--max-windows", "zero"]])
def test_argument_errors_exit_2_and_name_the_flag(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and args[-2] in capsys.readouterr().err


def test_generate_from_a_compressed_checkpoint(w4a16_checkpoint, capsys):
    code = main(["generate", "--model", str(w4a16_checkpoint), "--prompt", "The Python", "--max-new-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.startswith("The Python") and len(captured.out) > len("The Python\n")
    assert "8 tokens" in captured.err and "linear layers: dense x1, int4 (" in captured.err  # lm_head stays dense


def test_generate_quantizes_a_full_precision_checkpoint_on_load(capsys):
    code = main(["generate", "--model", str(trained_model_dir()), "--prompt", "def", "--max-new-tokens", "4", "--quantize", "8"])
    assert code == 0 and "linear layers: dense x1, int8 x28" in capsys.readouterr().err


def test_generate_compiled_decode_with_every_linear_in_int4(capsys):
    """--quantize-lm-head puts the output projection on the int4 kernel too; a few tokens decode
    uncompiled by default (a compile would cost more than it saves), --compile decodes through
    torch.compile (static cache) and reports the one-off compile; greedy text is the same."""
    args = ["generate", "--model", str(trained_model_dir()), "--prompt", "def", "--max-new-tokens", "6", "--quantize", "4", "--quantize-lm-head"]
    assert main(args) == 0
    eager = capsys.readouterr()
    assert "linear layers: int4 (" in eager.err and "dense" not in eager.err and "compiled" not in eager.err
    assert main([*args, "--compile"]) == 0
    compiled = capsys.readouterr()
    assert "compiled" in compiled.err and compiled.out == eager.out


def test_inspect_a_plain_checkpoint(capsys):
    assert main(["inspect", str(trained_model_dir())]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out


def test_under_torchrun_rank_zero_alone_warns(tmp_path):
    """The ranks run the same code on shares of one input and warn alike: a rank other than 0
    (``RANK``, as torchrun sets it) says only its errors."""
    from helpers import make_tiny_llama, token_batches

    make_tiny_llama(intermediate=200).save_pretrained(tmp_path / "model")  # groups of 128 do not divide 200: a warning
    data = tmp_path / "samples.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": b}) for b in token_batches(2, 16)))
    said = {}
    for rank in ("0", "1"):
        command = [sys.executable, "-m", "llmpress", "oneshot", "--model", str(tmp_path / "model"), "--recipe", "W4A16",
                   "--dataset", str(data), "--output", str(tmp_path / f"out{rank}"), "--seq-len", "16"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "RANK": rank, "TQDM_DISABLE": "1", "PYTHONPATH": str(Path(llmpress.__file__).parents[1])})
        assert done.returncode == 0, done.stderr[-2000:]
        said[rank] = done.stderr
    assert "vLLM and compressed-tensors refuse" in said["0"]
    assert "WARNING" not in said["1"] and "Warning" not in said["1"]
