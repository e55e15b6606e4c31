"""bench/job_rate.py runs as the docs say on a machine without a GPU (the
shared-memory transport): worker processes against the real daemon, every job
accounted for, and a plot drawn from what it wrote. The figures themselves are
the benchmark's, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_job_rate_benchmark_measures_a_node_of_workers_without_a_gpu(tmp_path):
    out = tmp_path / "rate.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "job_rate.py"), "--transport", "shm", "--grid", "2x4x2,1x1x4",
         "--seconds", "1", "--pool-size", "64MiB", "--shm-block-bytes", "16384", "--label", "smoke",
         "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    points = json.loads(out.read_text())["points"]
    assert [(p["workers"], p["blocks"], p["depth"]) for p in points] == [(2, 4, 2), (1, 1, 4)]
    for point in points:
        assert point["failed"] == 0
        assert point["jobs"] > 10 and point["jobs_per_s"] > 0
        assert 0 < point["p50_ms"] <= point["p99_ms"] and point["worst_p99_ms"] > 0
        # CPU from /proc (a thread's in ns): the thread that serves jobs (the native
        # lane's, or the event loop) did work in the window.
        assert point["path_thread"] in ("kvdepot-lane", "loop")
        assert point["daemon_cpu_us_per_job"] > 0 and point["path_cpu_us_per_job"] > 0
    assert "jobs/s" in run.stdout


def test_the_plot_shows_each_version_given(tmp_path):
    pytest.importorskip("matplotlib")
    files = []
    for label, scale in (("before", 1.0), ("after", 3.0)):
        points = [{"workers": w, "blocks": 4, "depth": 4, "jobs_per_s": 500.0 * w * scale,
                   "p50_ms": 1.0 * w / scale, "p99_ms": 2.0 * w / scale} for w in (1, 2, 4)]
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps({"label": label, "device": "a test", "date": "2026-11-27", "points": points}))
        files.append(str(path))
    plot = tmp_path / "rate.png"
    drawn = subprocess.run([sys.executable, str(REPO / "bench" / "job_rate.py"), "--plot", str(plot), *files],
                           capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0, drawn.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_files_draws_the_points_it_just_ran(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "rate.png"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "job_rate.py"), "--transport", "shm", "--grid", "1x2x2,2x2x2",
         "--seconds", "0.5", "--pool-size", "64MiB", "--shm-block-bytes", "16384", "--plot", str(plot),
         "--json", str(tmp_path / "rate.json")],
        capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "jobs/s" in run.stdout and f"wrote {plot}" in run.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A job size the run has no points of is named, with the ones it has.
    again = subprocess.run([sys.executable, str(REPO / "bench" / "job_rate.py"), "--plot", str(tmp_path / "x.png"),
                            "--plot-blocks", "64", str(tmp_path / "rate.json")],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "no points of 64-block jobs" in again.stderr
    assert "2 blocks at depth 2" in again.stderr


@pytest.mark.parametrize("bad, says", [
    (["--grid", "2x4"], "'2x4' is not a point WORKERSxBLOCKSxDEPTH"),
    (["--grid", "1x0x4"], "'1x0x4' is not a point"),
    (["--seconds", "0"], "--seconds must be more than 0"),
    (["--grid", "1x64x2", "--pool-size", "1MiB"], "more than half of the pool's 64"),
    (["--shm-block-bytes", "1000"], "a multiple of 256 bytes"),
    (["--json", "/nonexistent-folder/rate.json"], "--json /nonexistent-folder/rate.json: no folder"),
])
def test_a_run_that_cannot_measure_is_refused_before_it_starts(bad, says):
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "job_rate.py"), "--transport", "shm", "--grid", "1x4x4",
         "--seconds", "1", "--pool-size", "64MiB", "--shm-block-bytes", "16384", *bad],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode != 0 and says in run.stderr, run.stdout + run.stderr
    assert "jobs/s" not in run.stdout  # refused before any daemon or worker started


def test_stages_say_where_a_jobs_time_goes_in_the_daemon(tmp_path):
    out = tmp_path / "rate.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "job_rate.py"), "--transport", "shm", "--grid", "1x2x4",
         "--seconds", "1", "--pool-size", "64MiB", "--shm-block-bytes", "16384", "--stages", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (point,) = json.loads(out.read_text())["points"]
    assert set(point["stages_us"]) == {"store", "load"}
    for kind, steps in point["stages_us"].items():
        assert "received -> begin" in steps and "daemon" in steps, (kind, steps)
        for name, (p50, p99) in steps.items():
            if name != "outside the daemon":
                assert 0 <= p50 <= p99, (kind, name, p50, p99)
        # Both in µs: the daemon's part of a job is inside its submit-to-done.
        assert steps["daemon"][0] < point["p99_ms"] * 1e3
        assert steps["outside the daemon"][0] > 0
    assert "stores, µs p50/p99: received -> begin" in run.stdout


def test_the_benchmarks_daemon_has_its_whole_pool_up_before_anything_is_measured(monkeypatch):
    """The daemon serves once the first part of its pool is up and brings up
    the rest behind it, on its own threads; a benchmark's first point measured
    meanwhile would count that work as the jobs' (docs/benchmarks.md).
    bench/kvdepotd.py's wait_pool returns once it is all up."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from kvdepotd import BenchDaemon

    from kvdepot.client import KVDepotClient

    with BenchDaemon("1GiB", 1 << 20, pin="off") as daemon:
        daemon.wait_ready()
        daemon.wait_pool()
        client = KVDepotClient(daemon.socket, name="check").connect(60)
        try:
            pool = client.stats().pool
        finally:
            client.close()
    assert pool.num_slots == 1024 and pool.online_slots == pool.num_slots and not pool.bring_up_error
