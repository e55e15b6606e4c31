"""Shares in every tier: the disk tier and its promotions keep the pool's
share rule against a second uid. A tenant storing for a while cannot push
another tenant below its share of the disk, and one tenant's lookups cannot
take every promotion slot."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from conftest import subprocess_env, wait_until
from kvcache import NUM_BLOCKS, attach_worker, prompt_keys
from test_disk_tier_daemon import disk, fill_rounds, wait_ready
from test_trust import NOBODY, as_uid, needs_second_uid, start_shared

from kvdepot.server.core.shares import ScopedEviction
from kvdepot.server.host.shard_record import ShardRecord, data_hash
from kvdepot.server.tiers.disk_store import DiskTier

HERE = Path(__file__).resolve().parent


class Tenant:
    """tests/disk_tenant.py as another uid."""

    def __init__(self, daemon):
        self.proc = subprocess.Popen(
            [*as_uid(NOBODY), sys.executable, str(HERE / "disk_tenant.py"), daemon.socket],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=subprocess_env(), cwd="/",
        )
        assert self.answer() == {"ready": True}

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        return json.loads(line)

    def ask(self, command: str, prompt: int) -> dict:
        self.proc.stdin.write(f"{command} {prompt}\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def store_rounds_on_disk(tenant: Tenant, watcher, prompts) -> None:
    """The other tenant stores its rounds, each written to disk before the next
    (the watcher, an admin, sees the disk's counters)."""
    for prompt in prompts:
        want = disk(watcher.stats()).written_shards + NUM_BLOCKS
        assert tenant.ask("store", prompt) == {"ok": True}
        wait_until(lambda want=want: disk(watcher.stats()).written_shards >= want, what=f"round {prompt} on disk")


@needs_second_uid
def test_another_tenants_stores_do_not_push_a_tenant_below_its_share_of_the_disk(
    open_folder, start_daemon, client_factory, tmp_path
):
    # 16 MiB of disk: about 800 blocks, 400 each for two tenants.
    daemon = start_shared(start_daemon, open_folder, disk_dir=str(tmp_path / "disk"), disk_size="16MiB")
    victim = client_factory(daemon, name="victim")
    worker, engine, tensors = attach_worker(victim, seed=5)
    fill_rounds(victim, worker, tensors, 2, 1)  # 256 blocks on disk, under its half
    flood = Tenant(daemon)
    try:
        # Four times the disk, from the other uid.
        store_rounds_on_disk(flood, victim, range(1000, 1024))
    finally:
        flood.close()
    tier = disk(victim.stats())
    assert tier.evicted_shards >= 1024  # the flood went round the disk, its own records first
    for prompt in (0, 1):
        keys = prompt_keys(NUM_BLOCKS, prompt=prompt)
        assert wait_ready(victim, engine, keys) == NUM_BLOCKS, f"the victim's round {prompt} left the disk"


@needs_second_uid
def test_one_tenants_lookups_cannot_take_every_promotion_slot(open_folder, start_daemon, client_factory, tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    daemon = start_shared(
        start_daemon, open_folder, disk_dir=str(tmp_path / "disk"), disk_size="32MiB",
        launcher=str(HERE / "daemon_with_held_promotions.py"), env={"KVDEPOT_TEST_PROMOTION_GATE": str(gate)},
    )
    victim = client_factory(daemon, name="victim")
    worker, engine, tensors = attach_worker(victim, seed=6)
    fill_rounds(victim, worker, tensors, 2, 1)
    other = Tenant(daemon)
    try:
        # The other tenant's stores take its half of the pool: the victim's round 0
        # and the other's round 2000 are then on disk only.
        store_rounds_on_disk(other, victim, (2000, 2001))
        # (Seen from the engine's copy: a lookup now would start promotions itself.)
        first = prompt_keys(NUM_BLOCKS, prompt=0)
        wait_until(lambda: all(k in engine.lower for k in first), what="the victim's round 0 on disk only")
        (gate / "hold").touch()
        # Its lookup of 128 disk-only blocks starts promotions, which stay in flight:
        # 64 (every slot the daemon promotes into at once) before, its half now.
        assert other.ask("lookup", 2000) == {"ready": 0, "not_yet": True}
        answer = victim.lookup(engine, first)
        assert answer.ready_blocks == 0 and answer.not_yet, "the victim's promotion did not start"
        (gate / "hold").unlink()
        assert wait_ready(victim, engine, first) == NUM_BLOCKS
    finally:
        (gate / "hold").unlink(missing_ok=True)
        other.close()


# ---------------------------------------------------------------- the store's eviction, in process

def _fill_and_flood(tmp_path, interleaved: bool) -> tuple[int, int, int]:
    """Tenant A's records, alone or interleaved with B's, then B alone writing
    four times the disk: (A's records before, A's after, every record after)."""
    a, b = b"A" * 16, b"B" * 16
    rng = random.Random(7)

    def item(ns: bytes, i: int):
        data = rng.randbytes(16 << 10)
        return ShardRecord(ns, i.to_bytes(32, "little"), 0, 1, len(data), data_hash(data)), memoryview(data)

    def count(tier, ns):
        return sum(1 for k in tier.keys() if k[0] == ns)

    with DiskTier(str(tmp_path / "d"), 8 << 20, segment_bytes=1 << 20, direct="off") as tier:
        tier.shares.scope_of = lambda digest: digest[:1].decode()
        tier.shares.victims = ScopedEviction("lru", 1000).victims
        i = 0
        for _ in range(150 if interleaved else 300):
            tier.write([item(a, i), item(b, i + 1)] if interleaved else [item(a, i)])
            i += 2
        before = count(tier, a)
        for _ in range(2000):
            tier.write([item(b, i)])
            i += 1
        return before, count(tier, a), len(tier.keys())


def test_a_tenant_over_its_share_of_the_disk_loses_down_to_its_share_and_no_further(tmp_path):
    before, after, held = _fill_and_flood(tmp_path, interleaved=False)
    # A held nearly the whole disk (about 305 records fit); B's flood takes half of it, no more:
    # one 1 MiB segment is about 50 records.
    assert before == 300 and held // 2 - 50 <= after <= held // 2 + 50


def test_records_in_segments_shared_with_the_flooding_tenant_mostly_stay(tmp_path):
    """Segments both wrote: B's records leave the index first, and a segment
    goes only when A's share is exceeded. Its dropped records take room until
    then, so A keeps less than all (measured: 99 of 150), never none."""
    before, after, held = _fill_and_flood(tmp_path, interleaved=True)
    assert before == 150 and after >= before // 2
