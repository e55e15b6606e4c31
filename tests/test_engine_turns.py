"""bench/engine_turns.py: two engine processes take turns request by request (bench/hit_ttft.py
compares kvdepot with vLLM alone so), never serving at the same time."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import engine_turns  # noqa: E402

ENGINE = str(Path(__file__).resolve().parent / "turn_taking_engine.py")


def start(tmp_path, counts: dict[str, tuple[int, int]]):
    log = tmp_path / "log"
    log.touch()
    engines = {}
    for label, (count, die_at) in counts.items():
        side = engine_turns.BenchSide()
        proc = subprocess.Popen([sys.executable, ENGINE, label, str(count), str(die_at), str(log)],
                                env={**os.environ, **side.env}, pass_fds=side.pass_fds)
        side.started()
        engines[label] = (proc, side)
    return engines, log


def finish(engines) -> list[int]:
    codes = []
    for proc, side in engines.values():
        side.close()
        codes.append(proc.wait(10))
    return codes


def test_two_engines_serve_each_request_in_turn_never_at_once_and_alternate_who_goes_first(tmp_path):
    engines, log = start(tmp_path, {"plain": (5, 99), "kvdepot": (5, 99)})
    try:
        assert engine_turns.take_turns({label: side for label, (_, side) in engines.items()}) == 5
    finally:
        assert finish(engines) == [0, 0]
    lines = [line.split() for line in log.read_text().splitlines()]
    # Each start is followed by its own end before anything else starts: never two at once.
    assert [(who, what, i) for who, what, i, _ in lines[::2]] == [(who, "start", i) for who, _, i, _ in lines[::2]]
    assert all(a[0] == b[0] and a[2] == b[2] and b[1] == "end" for a, b in zip(lines[::2], lines[1::2]))
    starts = [(who, int(i)) for who, what, i, _ in lines if what == "start"]
    # Request by request, both engines, the one that went second going first next time.
    assert starts == [("plain", 0), ("kvdepot", 0), ("kvdepot", 1), ("plain", 1), ("plain", 2), ("kvdepot", 2),
                      ("kvdepot", 3), ("plain", 3), ("plain", 4), ("kvdepot", 4)]


def test_an_engine_that_dies_mid_run_ends_the_turns_with_an_error(tmp_path):
    engines, _ = start(tmp_path, {"plain": (5, 99), "kvdepot": (5, 2)})
    try:
        with pytest.raises(RuntimeError, match="not serving the same request"):
            engine_turns.take_turns({label: side for label, (_, side) in engines.items()})
    finally:
        engines["plain"][0].kill()
        assert finish(engines)[1] == 3
