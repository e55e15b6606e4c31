"""Time to serve after a restart with a full pool: cold, warm (SIGTERM) and after kill -9.

    python bench/warm_restart.py [--pool-size 4GiB] [--slot-size 2MiB] [--pool-dir DIR]
                                 [--batch 64] [--pin off] [--json OUT.json]

1. Cold: a daemon with --fresh on an address of its own, in the same pool
   folder, with a pool of the same size: from its process start to its
   "ready on" log line, and to the first lookup that answers READY (0 blocks).
   Its pool file is removed before the next step, so that the folder needs
   room for one pool only.
2. Fill: a daemon on the bench's address, and a CPU worker of this process
   (shared-memory transport) that stores blocks of exactly one slot (a
   block-major KV cache: K and V, 16 tokens, head dim 128, bf16, and as many
   heads (up to 8) and layers as fill the slot: 32 layers of 8 heads for the
   default 2 MiB, one layer of 2 heads for 16 KiB),
   --batch blocks a job, distinct keys, until every slot holds a block; then
   the time until every record is sealed (hashed, tiers/warm.py). Smaller
   slots give as many blocks as a large pool in a few GiB: what a restart
   does per block (reading the records, adopting) shows on any machine.
3. Warm: SIGTERM, and a daemon started again on the same address adopts the
   pool: from its process start to "ready on", the adoption's own seconds
   (its log line), and to the first lookup of a new client that finds every
   block ready; "slowest": the longest a lookup of one key took meanwhile,
   once the client was connected (calls wait while kept blocks come back).
   "pool up": from opening the pool to the whole of it faulted in and
   pinned, as the daemon logs it (each start waits for it). "GPU up": a
   pinned pool's daemon, once its CUDA transport is up (it comes up behind
   the start; a GPU worker's registration waits for it), from the time of
   its log line.
4. Kill -9: the warm daemon is killed and started again: the same figures.
   Then one batch is loaded back and its blocks checked.

Times are seconds from just before the daemon's Popen: they include Python's
start and imports. The pool files are removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvdepot.client import KVDepotClient  # noqa: E402
from kvdepot.defaults import grpc_target  # noqa: E402
from kvdepot.keys import KEY_VERSION  # noqa: E402
from kvdepot.pool_parts import is_part_name  # noqa: E402
from kvdepot.settings import parse_size  # noqa: E402

HEAD_DIM, BLOCK_SIZE = 128, 16
HEAD_BYTES = 2 * BLOCK_SIZE * HEAD_DIM * 2  # K and V of one head of one layer: 8 KiB
NAMESPACE = dict(model="warm-restart-bench", kv_dtype="bfloat16", block_size=BLOCK_SIZE, layout="block_major",
                 tp_size=1, key_version=KEY_VERSION)
POLL = 0.002

ADOPTED = re.compile(r"adopted (\d+) block\(s\) \((\d+) slots\) from the kept pool in ([\d.]+) s"
                     r"(?:; \d+ more wait[^;]*)?; shards discarded: (.*)")
# Where kept blocks come back as their part of the pool comes up: the last line says how many.
ADOPTED_LATE = re.compile(r"adopted (\d+) block\(s\) \((\d+) slots\) from the kept pool, the last as.*"
                          r"shards discarded: (.*)")
POOL_READY = re.compile(r"pool ready in ([\d.]+) s")
POOL_UP = re.compile(r"pool up: all|all of it up")
# Seconds from opening the pool to the whole of it up (faulted in and pinned), as the daemon logs it.
POOL_UP_AFTER = re.compile(r"pool up: all .* ([\d.]+) s after it was opened")
# A pinned pool's daemon brings its CUDA transport up behind the start; GPU workers wait for it.
PINNED = re.compile(r"pool ready in .*, pinned;")
TRANSPORT = re.compile(r"CUDA transport up ([\d.]+) s after the daemon began serving|the CUDA transport did not start")


class Daemon:
    """A kvdepotd on one address that can be started again (warm) or killed."""

    def __init__(self, folder: str, name: str, pool_size: str, slot_size: int, pool_dir: str, pin: str):
        self.folder, self.name = folder, name
        self.socket = os.path.join(folder, f"{name}.sock")
        self.args = [sys.executable, "-m", "kvdepot.server", "--listen", self.socket, "--pool-size", pool_size,
                     "--slot-size", str(slot_size), "--pool-dir", pool_dir, "--pin", pin]
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", KVDEPOT_METRICS_LISTEN="none")
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), self.env.get("PYTHONPATH")]))
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, *extra: str) -> float:
        """Starts the process; returns the monotonic time just before it."""
        self.starts += 1
        self.log_path = os.path.join(self.folder, f"{self.name}-{self.starts}.log")
        self._log = open(self.log_path, "wb")
        started = time.monotonic()
        self.started_at = time.time()  # the log's timestamps are wall-clock times
        self.proc = subprocess.Popen([*self.args, *extra], stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        self.started = started
        return started

    def seconds_at(self, line: re.Pattern) -> float | None:
        """Seconds from the process start to the first log line matching `line`, by its timestamp."""
        for text in self.log().splitlines():
            if line.search(text):
                stamp = datetime.datetime.strptime(text[:23], "%Y-%m-%d %H:%M:%S,%f")
                return stamp.timestamp() - self.started_at
        return None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 600) -> float:
        """Seconds from the process start to its "ready on" line (seen by polling the log)."""
        deadline = time.monotonic() + timeout
        while "ready on" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvdepotd ({self.name}) did not start:\n{self.log()[-6000:]}")
            time.sleep(POLL)
        return time.monotonic() - self.started

    def wait_for(self, line: re.Pattern, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not line.search(self.log()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvdepotd ({self.name}) never logged {line.pattern!r}:\n{self.log()[-6000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(300)
        self._log.close()
        if code != 0:
            raise SystemExit(f"kvdepotd ({self.name}) exited {code} on SIGTERM:\n{self.log()[-6000:]}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(60)
        self._log.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def keys_of(n: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n)]


def dram(client):
    [tier] = [t for t in client.stats().tiers if t.name == "dram"]
    return tier


LOOKUP_PART = 1 << 16  # keys a lookup: 2 MiB of them, under gRPC's 4 MiB a message


@dataclasses.dataclass
class Looked:
    available: bool
    not_yet: bool
    ready_blocks: int


def lookup_all(client, engine, keys: list[bytes]) -> Looked:
    """A lookup of `keys`, in parts of LOOKUP_PART: the ready blocks up to the first that is not."""
    ready = 0
    for first in range(0, max(1, len(keys)), LOOKUP_PART):
        part = keys[first : first + LOOKUP_PART]
        result = client.lookup(engine, part)
        ready += result.ready_blocks
        if not result.available or result.ready_blocks < len(part):
            return Looked(result.available, result.not_yet, ready)
    return Looked(True, False, ready)


def first_lookup(daemon: Daemon, keys: list[bytes], want: int, timeout: float = 600) -> dict:
    """Seconds from the daemon's process start to its "ready on" log line, and
    until a new client's lookup of `keys` answers READY with `want` blocks
    ready. The client is made at once and retries its connection every few
    ms; the log is polled in the same loop."""
    client = KVDepotClient(daemon.socket, name="warm-restart-lookup", backoff_initial=0.005, backoff_max=0.02)
    ready_s = hit_s = None
    slowest = 0.0
    # Blocks spread over the pool, asked one by one: the first hit (a daemon
    # may serve before every kept block is back).
    sample = keys[:: max(1, len(keys) // 16)]
    try:
        engine = client.register_engine(NAMESPACE)
        deadline = time.monotonic() + timeout
        while True:
            if ready_s is None and "ready on" in daemon.log():
                ready_s = time.monotonic() - daemon.started
            if want:
                # Each answered lookup of one key, timed: how long a call waits while kept blocks come back.
                for key in sample if hit_s is None else sample[:1]:
                    asked = time.monotonic()
                    answer = client.lookup(engine, [key])
                    if answer.available:
                        slowest = max(slowest, time.monotonic() - asked)
                    if hit_s is None and answer.ready_blocks:
                        hit_s = time.monotonic() - daemon.started
            result = lookup_all(client, engine, keys)
            if result.available and not result.not_yet and result.ready_blocks == want:
                lookup_s = time.monotonic() - daemon.started
                # The line is written before any call is answered: seen late only by the polling.
                return {"ready_s": lookup_s if ready_s is None else ready_s, "first_lookup_s": lookup_s,
                        "first_hit_s": lookup_s if hit_s is None else hit_s, "slowest_lookup_s": slowest}
            if not daemon.running or time.monotonic() > deadline:
                raise SystemExit(f"no lookup answered {want} ready (last: {result}):\n{daemon.log()[-6000:]}")
            time.sleep(POLL)
    finally:
        client.close(timeout=5)


def measure_start(daemon: Daemon, keys: list[bytes], want: int, *extra: str) -> dict:
    daemon.start(*extra)
    row = {**first_lookup(daemon, keys, want), "ready_blocks": want}
    daemon.wait_for(POOL_UP)
    if PINNED.search(daemon.log()):
        daemon.wait_for(TRANSPORT)
    log = daemon.log()
    if (m := TRANSPORT.search(log)) and m.group(1):
        row["gpu_up_s"] = daemon.seconds_at(TRANSPORT)
    if m := POOL_UP_AFTER.search(log):
        row["pool_up_s"] = float(m.group(1))
    if m := POOL_READY.search(log):
        row["pool_ready_s"] = float(m.group(1))
    if m := ADOPTED.search(log):
        row.update(adopted_blocks=int(m.group(1)), adopted_slots=int(m.group(2)), adoption_s=float(m.group(3)),
                   discarded=m.group(4))
    if m := ADOPTED_LATE.search(log):
        row.update(adopted_blocks=int(m.group(1)), adopted_slots=int(m.group(2)), discarded=m.group(3))
    return row


def block_shape(slot_bytes: int) -> tuple[int, int]:
    """(layers, heads) of a block of `slot_bytes` (a multiple of HEAD_BYTES)."""
    heads = math.gcd(slot_bytes // HEAD_BYTES, 8)
    return slot_bytes // HEAD_BYTES // heads, heads


def fill(daemon: Daemon, num_slots: int, batch: int, shape: tuple[int, int]) -> tuple[list[bytes], dict, torch.Tensor]:
    """Stores `num_slots` blocks of distinct keys; returns the keys, the
    figures, and the cache of the last batch (for the check at the end)."""
    client = KVDepotClient(daemon.socket, name="warm-restart-fill").connect(30)
    layers, heads = shape
    cache = torch.randn(batch, layers, 2, BLOCK_SIZE, heads, HEAD_DIM).to(torch.bfloat16)
    marks = cache.view(torch.int16).view(batch, -1)
    worker = client.register_worker(NAMESPACE, rank=0, tensors=[cache], block_dim=0)
    keys = keys_of(num_slots, "warm-restart")
    started = time.monotonic()
    job = 0
    for first in range(0, num_slots, batch):
        chunk = keys[first : first + batch]
        # Each block's first element says which block it is.
        marks[: len(chunk), 0] = torch.arange(first, first + len(chunk), dtype=torch.int16)
        job += 1
        client.submit_store(worker, job, chunk, list(range(len(chunk))))
        result = client.wait([job], 120)[job]
        if not result.ok:
            raise SystemExit(f"store job {job} failed: {result.error}\n{daemon.log()[-6000:]}")
    stored_s = time.monotonic() - started
    stats = client.stats()
    if stats.used_slots != num_slots or stats.totals.evicted_blocks:
        raise SystemExit(f"the pool is not full of the blocks stored: {stats.used_slots} of {num_slots} slots "
                         f"used, {stats.totals.evicted_blocks} evicted")
    deadline = time.monotonic() + 600
    while dram(client).written_shards < num_slots:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {dram(client).written_shards} of {num_slots} records sealed")
        time.sleep(0.01)
    sealed_s = time.monotonic() - started - stored_s
    client.close()
    stored_bytes = num_slots * layers * heads * HEAD_BYTES
    figures = {"blocks": num_slots, "store_s": stored_s, "store_gbps": stored_bytes / stored_s / 1e9,
               "sealed_after_s": sealed_s}
    return keys, figures, cache.clone()


def check_blocks(daemon: Daemon, keys: list[bytes], expected: torch.Tensor) -> int:
    """Loads the last batch back into a zeroed cache; returns how many blocks differ."""
    batch = expected.shape[0]
    first = ((len(keys) - 1) // batch) * batch
    chunk = keys[first:]
    client = KVDepotClient(daemon.socket, name="warm-restart-check").connect(30)
    try:
        cache = torch.zeros_like(expected)
        worker = client.register_worker(NAMESPACE, rank=0, tensors=[cache], block_dim=0)
        client.submit_load(worker, 1, chunk, list(range(len(chunk))))
        result = client.wait([1], 120)[1]
        if not result.ok:
            raise SystemExit(f"loading the last batch failed: {result.error}")
        return sum(not torch.equal(cache[i].view(torch.int16), expected[i].view(torch.int16))
                   for i in range(len(chunk)))
    finally:
        client.close()


def remove_pools(directory: str, prefixes: list[str]) -> list[str]:
    gone = []
    for name in os.listdir(directory):
        if any(name.startswith(p) for p in prefixes) and (name.endswith((".pool", ".namespaces.json"))
                                                           or is_part_name(name)):
            os.unlink(os.path.join(directory, name))
            gone.append(name)
    return gone


def pool_prefix(socket: str) -> str:
    # As server/daemon/main.py names the pool files of an address.
    return "kvdepot-" + hashlib.sha256(grpc_target(socket).encode()).hexdigest()[:12] + "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool-size", default="4GiB", help="e.g. 4GiB here, 16GiB or more on a GPU machine")
    p.add_argument("--slot-size", default="2MiB", help="a multiple of 8KiB: a block is that size")
    p.add_argument("--pool-dir", default=None, help="default: a new folder in /dev/shm (it must have room)")
    p.add_argument("--batch", type=int, default=64, help="blocks a store job")
    p.add_argument("--pin", default="off", help="the daemon's --pin (on with CUDA: the start then pins too)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--logs", default=None, help="copy the daemons' logs into this folder")
    args = p.parse_args()
    # The lookup clients are made before their daemon listens: their "not available" lines are expected.
    logging.getLogger("kvdepot.client").setLevel(logging.ERROR)

    pool_bytes, slot_bytes = parse_size(args.pool_size), parse_size(args.slot_size)
    if slot_bytes % HEAD_BYTES or not slot_bytes:
        raise SystemExit(f"--slot-size must be a multiple of {HEAD_BYTES >> 10} KiB: a block of one head of one layer")
    num_slots = pool_bytes // slot_bytes
    made_dir = args.pool_dir is None
    if made_dir:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
        # One pool at a time, its records, and the fill's KV cache copies in /dev/shm.
        need = pool_bytes + num_slots * 128 + 4 * args.batch * slot_bytes + (64 << 20)
        if free < need:
            raise SystemExit(f"/dev/shm has {free / 2**30:.2f} GiB free; a {pool_bytes / 2**30:.2f} GiB pool needs "
                             f"about {need / 2**30:.2f} GiB: lower --pool-size or give --pool-dir (a tmpfs with room)")
        pool_dir = tempfile.mkdtemp(prefix="kvdepot-warm-bench-", dir="/dev/shm")
    else:
        pool_dir = args.pool_dir
    folder = pool_dir if made_dir else tempfile.mkdtemp(prefix="kvdepot-warm-bench-", dir="/dev/shm")
    cold = Daemon(folder, "cold", args.pool_size, slot_bytes, pool_dir, args.pin)
    warm = Daemon(folder, "warm", args.pool_size, slot_bytes, pool_dir, args.pin)
    prefixes = [pool_prefix(cold.socket), pool_prefix(warm.socket)]
    rows: dict[str, dict] = {}
    out = {"pool_size": args.pool_size, "pool_bytes": num_slots * slot_bytes, "slot_bytes": slot_bytes,
           "num_slots": num_slots, "pool_dir": pool_dir, "pin": args.pin, "rows": rows}
    wall = time.monotonic()
    try:
        print(f"pool {num_slots * slot_bytes / 2**30:.2f} GiB, {num_slots} slots of {slot_bytes / 2**20:g} MiB, "
              f"in {pool_dir}; pin {args.pin}", flush=True)
        rows["cold (--fresh)"] = measure_start(cold, keys_of(8, "absent"), 0, "--fresh")
        cold.stop()
        remove_pools(pool_dir, prefixes[:1])

        warm.start("--fresh")
        warm.wait_ready()
        # Stores take the slots that are up: a fill before the whole pool is up would evict.
        warm.wait_for(POOL_UP)
        keys, out["fill"], last_batch = fill(warm, num_slots, args.batch, block_shape(slot_bytes))
        f = out["fill"]
        print(f"filled: {f['blocks']} blocks in {f['store_s']:.2f} s ({f['store_gbps']:.2f} GB/s); "
              f"every record sealed {f['sealed_after_s']:.2f} s after the last store", flush=True)

        warm.stop()
        rows["warm (after SIGTERM)"] = measure_start(warm, keys, num_slots)
        warm.kill()
        rows["warm (after kill -9)"] = measure_start(warm, keys, num_slots)
        out["blocks_differing_after_kill_9"] = check_blocks(warm, keys, last_batch)
        warm.stop()
    finally:
        for daemon in (cold, warm):
            if daemon.running:
                daemon.kill()
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            for name in sorted(os.listdir(folder)):
                if name.endswith(".log"):
                    shutil.copy(os.path.join(folder, name), args.logs)
        removed = remove_pools(pool_dir, prefixes)
        if made_dir:
            shutil.rmtree(pool_dir, ignore_errors=True)
        elif folder != pool_dir:
            shutil.rmtree(folder, ignore_errors=True)
    out["wall_s"] = time.monotonic() - wall
    out["removed_pool_files"] = removed

    header = (f"{'start':<22} {'ready on':>9} {'pool ready':>11} {'adoption':>9} {'1st hit':>8} {'all back':>9} "
              f"{'slowest':>8} {'blocks':>7} {'pool up':>8} {'GPU up':>8}  discarded")
    print(header)
    for name, row in rows.items():
        adoption = f"{row['adoption_s']:.2f}" if "adoption_s" in row else "-"
        gpu_up = f"{row['gpu_up_s']:.2f}s" if "gpu_up_s" in row else "-"
        print(f"{name:<22} {row['ready_s']:>8.2f}s {row.get('pool_ready_s', float('nan')):>10.2f}s "
              f"{adoption:>8}s {row['first_hit_s']:>7.2f}s {row['first_lookup_s']:>8.2f}s "
              f"{row['slowest_lookup_s']:>7.3f}s "
              f"{row.get('adopted_blocks', row['ready_blocks']):>7} {row.get('pool_up_s', float('nan')):>7.2f}s "
              f"{gpu_up:>8}  {row.get('discarded', '-')}")
    print(f"blocks of the last batch that differ after the kill -9 restart: {out['blocks_differing_after_kill_9']}")
    print(f"removed: {', '.join(removed) or 'nothing'}; wall {out['wall_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
