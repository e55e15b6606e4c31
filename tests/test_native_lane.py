"""Which lane a daemon runs, and why: the native one where it is built and
serves the configuration (where a compiler is there, as in CI, it must build:
a broken build would otherwise leave every test on the Python lane, unseen),
the Python one otherwise, with a line that says why; --lane native refuses
to start rather than run slower."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

from kvdepot.server.native import binding, build


def test_where_a_compiler_is_the_native_lane_builds_and_loads():
    if build.compiler() is None:
        pytest.skip("no C++ compiler here: the daemon runs the Python lane")
    built = build.build(quiet=True)
    lib = binding.load(built)
    assert lib.kvd_build_id().decode() == build.build_id()


def test_a_library_of_other_sources_is_not_loaded(tmp_path):
    """A library whose sources changed since (a checkout updated, not rebuilt)
    says another digest: the daemon does not run code that is not its own."""
    cxx = build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler here")
    stale = tmp_path / "_lane-stale.so"
    sources = [str(p) for p in sorted(build.SOURCES.glob("*.cpp"))]
    subprocess.run([cxx, *build.FLAGS, '-DKVD_BUILD_ID="0000000000000000"', *sources, "-o", str(stale)], check=True)
    with pytest.raises(OSError, match="built from other sources"):
        binding.load(stale)
    with pytest.raises(OSError, match="is not built"):
        binding.load(tmp_path / "_lane-missing.so")


def test_the_daemon_runs_the_native_lane_unless_told_otherwise(start_daemon):
    if build.compiler() is None:
        pytest.skip("no C++ compiler here")
    if os.environ.get("KVDEPOT_LANE") == "python":
        pytest.skip("this run of the suite asks for the Python lane")
    daemon = start_daemon()
    assert "per-job path: the native lane" in daemon.log()
    python = start_daemon(lane="python")
    assert "per-job path: the Python lane (--lane python)" in python.log()


def test_a_configuration_the_native_lane_cannot_serve_runs_the_python_lane_or_refuses(start_daemon, tmp_path):
    daemon = start_daemon(max_tp_size=128, lane="auto")
    assert "the Python lane, slower per job (--max-tp-size 128 is over the native lane's 64)" in daemon.log()
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.server", "--listen", str(tmp_path / "k.sock"), "--pool-size", "4MiB",
         "--slot-size", "16KiB", "--pin", "off", "--pool-dir", str(tmp_path), "--lane", "native",
         "--max-tp-size", "128"],
        capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--lane native: --max-tp-size 128 is over the native lane's 64" in proc.stderr
