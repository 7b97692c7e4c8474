"""Calibration files are read as far as the samples need, never whole (issue 42, group 7): a
1 GB text file costs what a small one costs; bad bytes and token ids are refused with where
they are."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from helpers import REPO, text_path, trained_model_dir
from transformers import AutoTokenizer

from llmpress.data import CalibrationOptions, load_calibration_samples
from llmpress.errors import DataError


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(trained_model_dir()))


def test_a_small_file_gives_the_samples_it_always_gave(tokenizer):
    """One read, one tokenizer call: the windows of the whole text, shuffled, as before."""
    path = text_path("calibration.txt")
    options = CalibrationOptions(num_samples=8, seq_len=64, seed=3)
    ids = torch.tensor(tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
    windows = list(ids[: ids.numel() // 64 * 64].reshape(-1, 64))
    random.Random(3).shuffle(windows)
    got = load_calibration_samples(path, tokenizer, options)
    assert all(torch.equal(a, b) for a, b in zip(got, windows[:8], strict=True))


_PEAK = """
import sys
sys.path.insert(0, {tests!r})
from transformers import AutoTokenizer
from llmpress.data import CalibrationOptions, load_calibration_samples
tokenizer = AutoTokenizer.from_pretrained({model!r})
samples = load_calibration_samples({path!r}, tokenizer, CalibrationOptions(num_samples=64, seq_len=256))
assert len(samples) == 64 and all(s.numel() == 256 for s in samples)
print([int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")][0])
"""


def _peak_kb(path):
    code = _PEAK.format(tests=str(REPO / "tests"), model=str(trained_model_dir()), path=str(path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
def test_a_1_gb_text_file_costs_what_a_small_one_costs(tmp_path):
    text = text_path("calibration.txt").read_text(encoding="utf-8")
    small = tmp_path / "small.txt"
    small.write_text(text * 4, encoding="utf-8")
    huge = tmp_path / "huge.txt"
    with open(huge, "w", encoding="utf-8") as handle:
        handle.write(text * 4)
        handle.write("x" * (40 << 20))  # one 40 MB line: it aborted the tokenizer, read whole
        handle.truncate(1 << 30)  # and then 1 GB (sparse: zero bytes are text too, and take no disk)
    assert _peak_kb(huge) - _peak_kb(small) < 100 * 1024


def test_bytes_that_are_not_utf8_are_refused_with_their_line(tmp_path, tokenizer):
    path = tmp_path / "latin1.txt"
    path.write_bytes("first line\nsecond line\ncaf\xe9 third\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"not UTF-8.*line 3"):
        load_calibration_samples(path, tokenizer, CalibrationOptions(num_samples=1, seq_len=4))


def test_token_ids_outside_the_vocabulary_are_refused(tokenizer):
    options = CalibrationOptions(num_samples=2, seq_len=4, shuffle=False)
    with pytest.raises(DataError, match=r"sample 1 has a token id outside.*got 70000"):
        load_calibration_samples([[1, 2, 3], [4, 70000, 5]], tokenizer, options, vocab_size=512)
    with pytest.raises(DataError, match="outside"):
        load_calibration_samples([[1, -2, 3]], tokenizer, options, vocab_size=512)


def test_a_json_lines_file_is_read_as_far_as_needed(tmp_path, tokenizer):
    path = tmp_path / "records.jsonl"
    lines = [json.dumps({"text": f"record {i} of the calibration file"}) for i in range(100)]
    path.write_text("\n".join(lines[:20]) + "\nnot json at all\n" + "\n".join(lines[20:]) + "\n", encoding="utf-8")
    samples = load_calibration_samples(path, tokenizer, CalibrationOptions(num_samples=4, seq_len=16))
    assert len(samples) == 4  # 16 records read: the bad line 21 is never reached
    with pytest.raises(DataError, match="line 21"):
        load_calibration_samples(path, tokenizer, CalibrationOptions(num_samples=8, seq_len=16))
