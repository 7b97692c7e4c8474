"""A full disk, a read-only folder, a file size limit: the run ends in a named llmpress error
(what, the file, the fix), exit status 2, no traceback, and an existing checkpoint intact
(issue 42, group 9)."""

from __future__ import annotations

import errno
import hashlib
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, text_path, trained_model_dir

from llmpress.errors import CheckpointError, os_failure

_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
from llmpress.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run_limited(limit, *args):
    return subprocess.run([sys.executable, "-c", _LIMITED.format(limit=limit), *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m") / "tiny"
    shutil.copytree(trained_model_dir(), folder)
    return folder


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and SIGXFSZ")
@pytest.mark.parametrize("limit", [100_000, 3_000_000])  # in the save / in the calibration's spill files
def test_a_run_that_cannot_write_ends_in_a_named_error(model, tmp_path, limit):
    recipe = tmp_path / "gptq.yaml"
    recipe.write_text("s_stage:\n  m_modifiers:\n    GPTQModifier: {targets: [Linear], ignore: [lm_head], scheme: W4A16}\n")
    result = _run_limited(limit, "oneshot", "--model", str(model), "--recipe", str(recipe), "--output", str(tmp_path / "out"),
                          "--dataset", str(text_path("calibration.txt")), "--num-samples", "8", "--seq-len", "128")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "error:" in result.stderr and "grew past what this system or its limits allow" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and SIGXFSZ")
def test_an_existing_checkpoint_survives_a_failed_overwrite(model, tmp_path):
    out = tmp_path / "out"
    assert _run_limited(1 << 40, "oneshot", "--model", str(model), "--recipe", "W8A16", "--output", str(out)).returncode == 0
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    result = _run_limited(200_000, "oneshot", "--model", str(model), "--recipe", "W4A16", "--output", str(out), "--overwrite")
    assert result.returncode == 2 and "could not write the checkpoint folder (nothing in it was changed)" in result.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("exc, what", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/out/model.safetensors"), "the disk is full"),
    (OSError(errno.EROFS, "Read-only file system", "/mnt/ro"), "read-only"),
    (PermissionError(errno.EACCES, "Permission denied", "/root/x"), "permission denied"),
    (Exception("No space left on device (os error 28)"), "the disk is full"),  # a Rust library's
])
def test_system_refusals_are_named_with_their_file(exc, what):
    error = os_failure(exc, "saving")
    assert isinstance(error, CheckpointError) and what in str(error)
    assert getattr(exc, "filename", None) is None or exc.filename in str(error)
