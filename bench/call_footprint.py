"""What a gRPC call costs the Python code that runs after it, in the same process.

    .venv/bin/python bench/call_footprint.py [--rounds 5] [--steps 2000]

Why this exists: bench/connector_overhead.py finds vLLM's scheduler running slower
when the engine's worker makes kvdepot calls between its steps, although the
scheduler's own code and call counts are unchanged. This isolates the effect.

A fixed piece of scheduler-like Python (walk 64 request objects six times: dict
gets, list appends) is timed on this thread's CPU clock, again and again, with
something different happening between two runs of it:

  nothing          back to back: the floor
  sleep            this thread sleeps 0.5 ms (its core idles)
  one call         this thread makes one unary call to a real kvdepotd (GetStats)
  calls            this thread makes two such calls
  calls elsewhere  a helper thread on another core makes the same two calls;
                   this thread waits for it
  python elsewhere the helper thread runs about 0.1 ms of plain Python instead;
                   this thread waits for it

Each figure is the median time of the piece, and its ratio to "nothing" measured
in the same round; the modes take turns, round after round.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_daemon import Daemon  # noqa: E402 - after the path above

from kvdepot.client import KVDepotClient  # noqa: E402


class Request:
    __slots__ = ("computed", "counts", "request_id", "tokens")

    def __init__(self, i: int):
        self.request_id = i
        self.tokens = list(range(100))
        self.counts: dict[int, int] = {}
        self.computed = 0


REQUESTS = [Request(i) for i in range(64)]


def scheduler_like_work() -> None:
    for _ in range(6):
        for r in REQUESTS:
            r.computed += 1
            r.tokens.append(r.computed)
            r.counts[r.computed & 31] = r.tokens[-1]
            if len(r.tokens) > 400:
                del r.tokens[:300]


def plain_python() -> None:
    table = {}
    for i in range(3000):
        table[i] = (i, None, True, str(i))


class Helper:
    """A thread on another core that runs what it is given while the caller waits."""

    def __init__(self, cpu: int | None):
        self._todo: queue.Queue = queue.Queue()
        self._cpu = cpu
        threading.Thread(target=self._run, daemon=True, name="footprint-helper").start()

    def _run(self) -> None:
        if self._cpu is not None:
            os.sched_setaffinity(0, {self._cpu})
        while True:
            fn, done = self._todo.get()
            fn()
            done.set()

    def run(self, fn) -> None:
        done = threading.Event()
        self._todo.put((fn, done))
        done.wait()


def median_us(between, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.thread_time_ns()
        scheduler_like_work()
        times.append(time.thread_time_ns() - start)
        between()
    return statistics.median(times) / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000, help="timed pieces per mode and round")
    args = parser.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs two CPUs: one for this thread, one for the helper")
    folder = Path(tempfile.mkdtemp(prefix="kvdepot-footprint-"))
    daemon = Daemon(folder, "64MiB", "64KiB")
    try:
        client = KVDepotClient(daemon.socket, name="call-footprint").connect(30)
        os.sched_setaffinity(0, {cpus[0]})  # this thread; the helper and grpc's threads are elsewhere
        helper = Helper(cpus[1])

        def two_calls() -> None:
            client.stats()
            client.stats()

        modes = {
            "nothing": lambda: None,
            "sleep": lambda: time.sleep(0.0005),
            "one call": client.stats,
            "calls": two_calls,
            "calls elsewhere": lambda: helper.run(two_calls),
            "python elsewhere": lambda: helper.run(plain_python),
        }
        results: dict[str, list[float]] = {name: [] for name in modes}
        for round_ in range(args.rounds):
            for name, between in modes.items():
                results[name].append(median_us(between, args.steps))
            print(
                f"round {round_ + 1}/{args.rounds}: "
                + ", ".join(f"{n} {v[-1]:.1f}" for n, v in results.items())
                + " us",
                file=sys.stderr,
                flush=True,
            )
        client.close()
    finally:
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)

    print(
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}; "
        f"{args.rounds} rounds of {args.steps} pieces per mode\n"
    )
    print("| between two runs of the piece | piece, median us | ratio to nothing |")
    print("| --- | --- | --- |")
    for name, values in results.items():
        ratios = [v / n for v, n in zip(values, results["nothing"])]
        print(f"| {name} | {statistics.median(values):.1f} | {statistics.median(ratios):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
