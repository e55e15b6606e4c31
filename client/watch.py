"""`kvdepot stats --watch`: a refreshing view of a daemon's stats, like top.

Rates come from two consecutive GetStats answers of one daemon instance, over
the daemon's uptime between them (not the CLI's clock, so a slow answer does
not skew them). A daemon that goes away or restarts is said so in the view,
and the watch reconnects and goes on.
"""

from __future__ import annotations

import shutil
import signal
import sys
import termios
import time
from collections.abc import Callable, Mapping
from typing import TextIO, TypeVar

from kvdepot.errors import KVDepotError
from kvdepot.proto import kvdepot_pb2 as pb

# Counters shown per second.
RATE_FIELDS = (
    "stored_bytes", "loaded_bytes", "stored_blocks", "loaded_blocks", "lookups", "hit_blocks", "miss_blocks",
    "evicted_blocks", "failed_jobs",
)

# The alternate screen (the shell's screen comes back on exit, as with top),
# cursor hidden; and what undoes both.
ENTER_SCREEN = "\x1b[?1049h\x1b[?25l"
LEAVE_SCREEN = "\x1b[?25h\x1b[?1049l"
REDRAW = "\x1b[H\x1b[2J"

K = TypeVar("K")


# ------------------------------------------------------------ the arithmetic


def interval_seconds(before: pb.GetStatsResponse | None, after: pb.GetStatsResponse) -> float | None:
    """Seconds between two answers of one daemon; None when they cannot give
    rates: no earlier answer, another instance (the daemon restarted and its
    counters began anew), or no time passed."""
    if before is None or before.daemon_instance != after.daemon_instance:
        return None
    seconds = after.uptime_seconds - before.uptime_seconds
    return seconds if seconds > 0 else None


def counter_rates(before: pb.Counters, after: pb.Counters, seconds: float) -> dict[str, float]:
    """Each of RATE_FIELDS per second. A counter that went down counts 0: a
    non-admin's totals are the sum of its namespaces', and a namespace that is
    freed takes its counts with it."""
    return {name: max(0, getattr(after, name) - getattr(before, name)) / seconds for name in RATE_FIELDS}


def keyed_rates(before: Mapping[K, pb.Counters], after: Mapping[K, pb.Counters],
                seconds: float) -> dict[K, dict[str, float]]:
    """Rates of the namespaces (or clients) present in both answers."""
    return {key: counter_rates(before[key], counters, seconds) for key, counters in after.items() if key in before}


def hit_ratio(rates: Mapping[str, float]) -> float | None:
    """Blocks found ready out of blocks looked up, over the interval; None without lookups."""
    asked = rates["hit_blocks"] + rates["miss_blocks"]
    return rates["hit_blocks"] / asked if asked else None


def byte_rate(bytes_per_second: float) -> str:
    """Decimal units, as GB/s elsewhere in kvdepot; small rates in MB/s or kB/s rather than 0.00 GB/s."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_second >= scale:
            return f"{bytes_per_second / scale:.2f} {unit}"
    return f"{bytes_per_second:.0f} B/s"


def byte_size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def clock(timestamp: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(timestamp))


def _gib_of(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def block_size(n: int) -> str:
    """Exact: two block sizes never read the same (65,536 and 65,537 bytes
    are two layouts, and the second wastes most of a second slot)."""
    if not n:
        return "unknown"
    if n % 2**20 == 0:
        return f"{n >> 20:,} MiB"
    return f"{n >> 10:,} KiB" if n % 2**10 == 0 else f"{n:,} B"


def holds_lines(stats: pb.GetStatsResponse) -> list[str]:
    """What the DRAM holds: KV bytes, free bytes, fragmentation, and by block
    size (`kvdepot stats` shows the same lines)."""
    slot = stats.pool.slot_bytes
    lines = [
        f"holds     {_gib_of(stats.kv_bytes)} of KV in {_gib_of(stats.used_slots * slot)} of slots "
        f"({100 * stats.fragmentation:.0f}% of those slots' bytes empty: fragmentation); "
        f"{_gib_of(stats.free_bytes)} free, {_gib_of(stats.free_any_size_bytes)} of it for blocks of any size"
    ]
    for size in stats.block_sizes:
        span = -(-size.block_bytes // slot) if slot else 0
        fill = (f", {span} slot{'s' * (span != 1)} a block, {100 * size.block_bytes / (span * slot):.0f}% full"
                if span else "")
        plural = "s" if size.namespaces != 1 else ""
        lines.append(f"  blocks of {block_size(size.block_bytes)}: {size.used_slots} slots, "
                     f"{_gib_of(size.used_bytes)} of KV ({size.namespaces} namespace{plural}{fill})")
    return lines


def numa_lines(stats: pb.GetStatsResponse) -> list[str]:
    """The pool's NUMA nodes: each node's range of slots, its use and its GPUs
    (`kvdepot stats` shows the same lines)."""
    lines = []
    for n in stats.numa_nodes:
        gpus = "; GPUs " + ", ".join(n.gpus) if n.gpus else "; no GPU"
        if not stats.numa_carved:
            where = f"one memory node ({n.node})" if n.node >= 0 else "several memory nodes, or none known"
            lines.append(f"numa      pool not carved: {where}{gpus}")
            continue
        share = 100 * n.used_slots / n.slots if n.slots else 0.0
        lines.append(f"numa      node {n.node}: slots {n.first_slot}-{n.first_slot + n.slots - 1}, {n.used_slots} used "
                     f"({share:.1f}%), {'placed' if n.bound else 'not placed'}{gpus}")
    if stats.numa_carved and stats.numa_gpus_elsewhere:
        lines.append("numa      on no node of the pool (stores take the range with the most free slots): GPUs "
                     + ", ".join(stats.numa_gpus_elsewhere))
    return lines


# ------------------------------------------------------------ the view


class WatchView:
    """What the watch knows: the last two answers, and what happened to the daemon."""

    def __init__(self, target: str, interval: float, now: Callable[[], float] = time.time):
        self.target = target
        self.interval = interval
        self._now = now
        self.before: pb.GetStatsResponse | None = None
        self.latest: pb.GetStatsResponse | None = None
        self.unreachable_since: float | None = None
        self.reason = ""
        # The last thing that happened to the daemon (a restart, a return); kept in view.
        self.event = ""

    def answered(self, stats: pb.GetStatsResponse) -> None:
        if self.latest is not None and self.latest.daemon_instance != stats.daemon_instance:
            started = self._now() - stats.uptime_seconds
            self.event = f"kvdepotd restarted at {clock(started)} (instance {stats.daemon_instance}): rates restart"
        elif self.unreachable_since is not None:
            self.event = f"kvdepotd answers again since {clock(self._now())}"
        self.before, self.latest = self.latest, stats
        self.unreachable_since = None

    def failed(self, reason: str) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = self._now()
        self.reason = reason

    def render(self) -> list[str]:
        lines = [f"kvdepot stats --watch {self.interval:g}   {self.target}   {clock(self._now())}"]
        if self.unreachable_since is not None:
            lines.append(f"kvdepotd is not reachable at {self.target} since {clock(self.unreachable_since)}: "
                         f"{self.reason}")
        if self.event:
            lines.append(self.event)
        if self.unreachable_since is None and self.latest is not None:
            lines.append("")
            lines += self._stats_lines(self.latest, interval_seconds(self.before, self.latest))
        return lines

    def _stats_lines(self, stats: pb.GetStatsResponse, seconds: float | None) -> list[str]:
        pool = stats.pool
        rates = counter_rates(self.before.totals, stats.totals, seconds) if seconds else None
        lines = [
            f"kvdepotd {stats.daemon_version} (instance {stats.daemon_instance}), up {stats.uptime_seconds:.0f} s, "
            f"{stats.eviction_policy}",
            f"pool      {byte_size(pool.num_slots * pool.slot_bytes)}, occupancy {100 * stats.occupancy:.1f}% "
            f"({stats.used_slots} of {pool.num_slots} slots, {stats.pinned_slots} pinned by jobs)",
        ]
        if rates is None:
            lines.append("rates     (from the next refresh on)")
        else:
            ratio = hit_ratio(rates)
            lines += [
                f"store     {byte_rate(rates['stored_bytes'])}  ({rates['stored_blocks']:.1f} blocks/s)",
                f"load      {byte_rate(rates['loaded_bytes'])}  ({rates['loaded_blocks']:.1f} blocks/s)",
                f"lookups   {rates['lookups']:.1f}/s: {rates['hit_blocks']:.1f} hits/s, "
                f"{rates['miss_blocks']:.1f} misses/s" + (f" ({100 * ratio:.1f}% hit)" if ratio is not None else ""),
                f"evictions {rates['evicted_blocks']:.1f}/s; failed jobs {rates['failed_jobs']:.1f}/s",
            ]
        lines += holds_lines(stats)
        lines += numa_lines(stats)
        in_flight = sum(c.jobs_in_flight for c in stats.clients)
        lines.append(f"sessions  {len(stats.clients)} attached, {stats.sessions_ended} ended; "
                     f"{in_flight} jobs in flight")
        lines += ["", *self._namespace_lines(stats, seconds), "", *self._client_lines(stats, seconds)]
        return lines

    def _namespace_lines(self, stats: pb.GetStatsResponse, seconds: float | None) -> list[str]:
        rates = keyed_rates({ns.name: ns.counters for ns in self.before.namespaces},
                            {ns.name: ns.counters for ns in stats.namespaces}, seconds) if seconds else {}
        lines = [f"{'namespace':<48} {'slots':>7} {'pool':>6} {'hits/s':>8} {'store':>11} {'load':>11}"]
        for ns in stats.namespaces:
            share = ns.used_slots / stats.pool.num_slots if stats.pool.num_slots else 0.0
            columns = _rate_columns(rates.get(ns.name))
            lines.append(f"{ns.name[:48]:<48} {ns.used_slots:>7} {100 * share:>5.1f}% " + columns)
        if stats.namespaces_omitted:
            lines.append(f"(and {stats.namespaces_omitted} more)")
        elif not stats.namespaces:
            lines.append("(no namespaces you may see)")
        return lines

    def _client_lines(self, stats: pb.GetStatsResponse, seconds: float | None) -> list[str]:
        rates = keyed_rates({c.session_number: c.counters for c in self.before.clients},
                            {c.session_number: c.counters for c in stats.clients}, seconds) if seconds else {}
        lines = [f"{'client':<24} {'tenant':<14} {'pid':>7} {'workers':>7} {'jobs':>5} {'hits/s':>8} "
                 f"{'store':>11} {'load':>11}"]
        for c in stats.clients:
            lines.append(f"{c.client_name[:24]:<24} {c.tenant[:14]:<14} {c.pid:>7} {c.workers:>7} "
                         f"{c.jobs_in_flight:>5} " + _rate_columns(rates.get(c.session_number)))
        if stats.clients_omitted:
            lines.append(f"(and {stats.clients_omitted} more)")
        elif not stats.clients:
            lines.append("(no sessions you may see)")
        return lines


def _rate_columns(rates: Mapping[str, float] | None) -> str:
    if rates is None:
        return f"{'-':>8} {'-':>11} {'-':>11}"
    return f"{rates['hit_blocks']:>8.1f} {byte_rate(rates['stored_bytes']):>11} {byte_rate(rates['loaded_bytes']):>11}"


# ------------------------------------------------------------ the loop


def _poll(client, connect: Callable[[], object]):
    """(client, stats, None), or (None, None, the error). A client that fails
    is replaced at once, once: its session may be of a daemon that restarted."""
    error: KVDepotError | None = None
    for _ in range(1 if client is None else 2):
        try:
            if client is None:
                client = connect()
            return client, client.stats(), None
        except KVDepotError as e:
            if client is not None:
                _close(client)
            client, error = None, e
    return None, None, error


def _close(client) -> None:
    try:
        client.close()
    except Exception:  # a connection the daemon took down with it
        pass


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(connect: Callable[[], object], target: str, interval: float, client=None, out: TextIO = sys.stdout) -> int:
    """Refreshes every `interval` seconds until Ctrl-C (or SIGTERM), then exits 0.

    On a terminal the view is redrawn in place; elsewhere each refresh is
    appended as a block, so that it can be logged.
    """
    tty = out.isatty()
    view = WatchView(target, interval)
    keyboard = _hide_typing() if tty else None
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if tty:
            out.write(ENTER_SCREEN)
        while True:
            started = time.monotonic()
            client, stats, error = _poll(client, connect)
            if stats is not None:
                view.answered(stats)
            else:
                view.failed(str(error))
            lines = view.render()
            if tty:
                columns, rows = shutil.get_terminal_size()
                out.write(REDRAW + "\n".join(line[:columns] for line in lines[:rows]))
            else:
                out.write("\n".join(lines) + "\n\n")
            out.flush()
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        if client is not None:
            _close(client)
        if tty:
            out.write(LEAVE_SCREEN)
            out.flush()
        if keyboard is not None:
            termios.tcsetattr(*keyboard)


def _hide_typing():
    """Turns off the echo of keys typed into the view; (fd, when, settings) that restore it."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        return None
    saved = termios.tcgetattr(fd)
    quiet = termios.tcgetattr(fd)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSADRAIN, quiet)
    return fd, termios.TCSADRAIN, saved
