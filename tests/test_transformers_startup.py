"""The command's shared scan of transformers' model folder: the same model table, one scan."""

from __future__ import annotations

import json
import subprocess
import sys

# In a fresh interpreter: transformers' lazy table of model classes, and how many folder scans
# missed the cache and how many were served from it.
_PROBE = """
import json, sys
from llmpress.integrations.transformers_startup import share_model_folder_scan
installed = share_model_folder_scan() if sys.argv[1] == "shared" else False
import transformers.models
from transformers.utils import import_utils
scan = import_utils.create_import_structure_from_path
scan = scan.__wrapped__ if installed else scan  # the cached function under the wrapper
table = sys.modules["transformers.models"]
print(json.dumps({
    "installed": installed,
    "hits": scan.cache_info().hits,
    "classes": sorted(table._class_to_module.items()),
    "modules": sorted(table._modules),
    "missing": sorted((k, sorted(map(str, v))) for k, v in table._object_missing_backend.items()),
    "again": share_model_folder_scan(),
}))
"""


def _probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_shared_scan_builds_the_same_model_table_from_one_scan():
    plain, shared = _probe("plain"), _probe("shared")
    assert not plain["installed"] and shared["installed"]
    assert plain["hits"] == 0  # without it, the model folder is scanned twice
    assert shared["hits"] >= 1  # with it, the second scan is the first one's result
    assert len(shared["classes"]) > 1000  # a real table: every model class transformers has
    for key in ("classes", "modules", "missing"):
        assert shared[key] == plain[key], key
    assert not shared["again"]  # the table is built: nothing more to share, nothing installed twice


_COMMAND_START = """
import sys
from llmpress import gc_pause
if sys.argv[1] == "own":
    gc_pause.own_process()
from llmpress.cli import _import_library
_import_library(sys.argv[2])
from transformers.utils import import_utils
print(bool(getattr(import_utils.create_import_structure_from_path, "_llmpress_by_folder", False)),
      "transformers.models" in sys.modules)
"""


def test_only_the_command_in_its_own_process_shares_the_scan():
    def start(owner: str, command: str) -> str:
        done = subprocess.run([sys.executable, "-c", _COMMAND_START, owner, command], capture_output=True, text=True, check=True)
        return done.stdout.split()[-2]

    assert start("own", "oneshot") == "True"
    assert start("library", "oneshot") == "False"  # llmpress.cli.main inside someone else's process
    assert start("own", "inspect") == "False"  # a command that loads no model imports no transformers for it
