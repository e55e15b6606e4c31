"""Torch's (and Triton's) largest libraries loaded before their import,
without Python's lock (server/daemon/preload.py): the import then uses them,
and one that does not load leaves the rest to the import. Each in a fresh
interpreter, since a library once loaded stays."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import subprocess_env

from kvdepot.server.daemon import preload


def in_fresh_interpreter(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_torchs_libraries_load_first_and_its_import_uses_them():
    result = in_fresh_interpreter("""
import json, os, sys
from kvdepot.server.daemon import preload
loaded = preload.load(preload.libraries("torch"))
before = "torch" in sys.modules
import torch
maps = [line.split()[-1] for line in open("/proc/self/maps") if "libtorch_cpu" in line]
print(json.dumps({"loaded": [os.path.basename(p) for p in loaded], "imported_before": before,
                  "maps": sorted(set(maps)), "sum": float(torch.ones(3).sum())}))
""")
    assert result["loaded"] == ["libtorch_global_deps.so", "libc10.so", "libtorch_cpu.so"], result
    assert not result["imported_before"]
    # One copy of the library, the one in torch's folder, which torch then computes with.
    assert len(result["maps"]) == 1 and result["maps"][0].startswith(preload.package_folder("torch")), result
    assert result["sum"] == 3.0


def test_a_library_that_does_not_load_leaves_the_rest_to_the_import(tmp_path):
    broken = tmp_path / "libnot_a_library.so"
    broken.write_bytes(b"not an ELF file")
    result = in_fresh_interpreter(f"""
import json, os
from kvdepot.server.daemon import preload
first = preload.load([({str(broken)!r}, os.RTLD_NOW)] + preload.libraries("torch"))
import torch
print(json.dumps({{"loaded": first, "sum": float(torch.ones(2).sum())}}))
""")
    assert result == {"loaded": [], "sum": 2.0}


def test_nothing_to_load_without_the_package():
    assert preload.package_folder("no_such_package_of_kvdepot") is None
    assert os.path.isdir(preload.package_folder("torch"))
    if preload.package_folder("triton") is None:  # CI's machines have no Triton
        assert preload.libraries("triton") == []


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed here")
def test_tritons_library_loads_first_and_its_import_uses_it():
    result = in_fresh_interpreter("""
import json, os
from kvdepot.server.daemon import preload
loaded = preload.load_all()
import triton.language
maps = {line.split()[-1] for line in open("/proc/self/maps") if "libtriton" in line}
print(json.dumps({"loaded": [os.path.basename(p) for p in loaded], "maps": sorted(maps)}))
""")
    assert "libtriton.so" in result["loaded"], result
    assert len(result["maps"]) == 1, result
