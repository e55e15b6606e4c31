"""Libraries loaded before their package's import, without Python's lock
(server/daemon/preload.py): other threads go on running meanwhile, the
import then uses the loaded copy, and one that does not load leaves the rest
to the import. Each in a fresh interpreter, since a library once loaded
stays."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest
from conftest import subprocess_env

from kvdepot.server.daemon import preload

# Its constructor takes half a second, as a large library's loading does.
SLOW_LIBRARY = """
#include <unistd.h>
__attribute__((constructor)) static void slow(void) { usleep(500000); }
"""


def in_fresh_interpreter(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def slow_library(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here")
    source, library = tmp_path / "slow.c", tmp_path / "libslow.so"
    source.write_text(SLOW_LIBRARY)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def test_other_threads_run_python_while_a_library_loads(slow_library):
    """The point of the preload: Python's import and ctypes.CDLL hold the
    interpreter's lock through the half second (0 ticks of the other thread)."""
    result = in_fresh_interpreter(f"""
import json, os, threading, time
from kvdepot.server.daemon import preload
ticks, stop = [], threading.Event()
def tick():
    while not stop.is_set():
        ticks.append(time.monotonic())
        time.sleep(0.001)
thread = threading.Thread(target=tick)
thread.start()
time.sleep(0.05)
started = time.monotonic()
loaded = preload.load([({str(slow_library)!r}, os.RTLD_NOW)])
ended = time.monotonic()
stop.set()
thread.join()
print(json.dumps({{"loaded": loaded, "seconds": ended - started,
                  "ticks": sum(started < t < ended for t in ticks)}}))
""")
    assert result["loaded"] == [str(slow_library)] and result["seconds"] >= 0.5, result
    assert result["ticks"] >= 10, result


def test_a_library_that_does_not_load_leaves_the_rest_to_the_import(tmp_path, slow_library):
    broken = tmp_path / "libnot_a_library.so"
    broken.write_bytes(b"not an ELF file")
    result = in_fresh_interpreter(f"""
import json, os
from kvdepot.server.daemon import preload
loaded = preload.load([({str(broken)!r}, os.RTLD_NOW), ({str(slow_library)!r}, os.RTLD_NOW)])
mapped = any("libslow" in line for line in open("/proc/self/maps"))
print(json.dumps({{"loaded": loaded, "mapped": mapped}}))
""")
    assert result == {"loaded": [], "mapped": False}


def test_nothing_to_load_without_the_package():
    assert preload.package_folder("no_such_package_of_kvdepot") is None
    if preload.package_folder("triton") is None:  # CI's machines have no Triton
        assert preload.libraries("triton") == [] and preload.load_all() == []


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
    assert result["loaded"] == ["libtriton.so"], result
    assert len(result["maps"]) == 1 and result["maps"][0].startswith(preload.package_folder("triton")), result
