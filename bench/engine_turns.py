"""Engines taking turns request by request: two engine processes up at once, each request served
by one while the other waits, so that both see the machine as it is at that moment (a slow minute
of the host slows both alike) and never compete for its cores.

An engine process (bench/serving_ttft.py's Runner) asks for its turn before each request and says
when the request is done, over two pipes the benchmark passes it (KVDEPOT_BENCH_TURN_FDS="r,w"):
it writes "ready NAME" and blocks until it reads "go", and writes "done NAME" when the request's
last token is out. The benchmark (`take_turns`) lets them go one at a time, in turn.
"""

from __future__ import annotations

import os

ENV = "KVDEPOT_BENCH_TURN_FDS"


class EngineSide:
    """An engine process's end: None from `from_env` where no benchmark hands out turns."""

    def __init__(self, read_fd: int, write_fd: int):
        self._in = os.fdopen(read_fd, "r")
        self._out = os.fdopen(write_fd, "w")

    @classmethod
    def from_env(cls) -> EngineSide | None:
        fds = os.environ.get(ENV)
        if not fds:
            return None
        read_fd, write_fd = (int(x) for x in fds.split(","))
        return cls(read_fd, write_fd)

    def before(self, name: str) -> None:
        self._out.write(f"ready {name}\n")
        self._out.flush()
        line = self._in.readline()
        if line.strip() != "go":
            raise RuntimeError(f"the benchmark ended the turns before {name} ({line!r})")

    def after(self, name: str) -> None:
        self._out.write(f"done {name}\n")
        self._out.flush()


class BenchSide:
    """The benchmark's end of one engine's pipes; `pass_fds` and `env` go to its Popen."""

    def __init__(self):
        self._to_engine_r, to_engine_w = os.pipe()
        from_engine_r, self._from_engine_w = os.pipe()
        self._go = os.fdopen(to_engine_w, "w")
        self._said = os.fdopen(from_engine_r, "r")
        self.pass_fds = (self._to_engine_r, self._from_engine_w)
        self.env = {ENV: f"{self._to_engine_r},{self._from_engine_w}"}

    def started(self) -> None:
        """After the Popen: the engine's ends are its own now (an engine that dies ends our reads)."""
        os.close(self._to_engine_r)
        os.close(self._from_engine_w)

    def expect(self, word: str) -> str | None:
        """The request name after `word`; None once the engine closed its end (it finished or died)."""
        line = self._said.readline()
        if not line:
            return None
        said, _, name = line.strip().partition(" ")
        if said != word:
            raise RuntimeError(f"an engine said {line!r} where {word!r} was expected")
        return name

    def go(self) -> None:
        self._go.write("go\n")
        self._go.flush()

    def close(self) -> None:
        self._go.close()
        self._said.close()


def take_turns(engines: dict[str, BenchSide]) -> int:
    """Lets each engine serve one request in turn until every engine has served all of its own;
    who goes first alternates request by request. Both must serve the same requests in the same
    order. Returns the number of turns each took."""
    order = list(engines)
    turns = 0
    while True:
        ready = {}
        for label in order:
            name = engines[label].expect("ready")
            if name is not None:
                ready[label] = name
        if not ready:
            return turns
        if len(ready) != len(order) or len(set(ready.values())) != 1:
            raise RuntimeError(f"the engines are not serving the same request: {ready}")
        for label in order:
            side = engines[label]
            side.go()
            if side.expect("done") != ready[label]:
                raise RuntimeError(f"{label} did not finish {ready[label]} in its turn")
        turns += 1
        order.reverse()
