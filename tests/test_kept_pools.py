"""Pools kept by stopped daemons are bounded and visible: each names its
address and when it was kept; a daemon at start discards its user's kept pools
that no live daemon serves once they are older than --kept-pool-max-age, or the
oldest while they hold more than --kept-pools-max-bytes; `kvdepot pools` lists
and discards them. A live daemon's pool is never touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import subprocess_env

from kvdepot import kept_pools
from kvdepot.keys import KEY_VERSION
from kvdepot.server.host.shard_record import FORMAT_VERSION


def pool_of(folder: Path, daemon) -> Path:
    """The pool file in `folder` whose header names `daemon`'s socket."""
    for path in folder.glob("*.pool"):
        header, _ = kept_pools.read_header(str(path))
        if header and header["address"] == "unix:" + daemon.socket:
            return path
    raise AssertionError(f"no pool of {daemon.socket} in {sorted(folder.iterdir())}")


def age(path: Path, seconds: float) -> None:
    """Rewrites a kept pool's header as if its daemon had stopped `seconds` ago."""
    header, why = kept_pools.read_header(str(path))
    assert header, why
    raw = kept_pools.pack_header(FORMAT_VERSION, KEY_VERSION, header["slot_bytes"], header["num_slots"],
                                 header["file_size"], header["address"], header["lock"], time.time() - seconds)
    with open(path, "r+b") as f:
        f.seek(header["file_size"] - kept_pools.HEADER_BYTES)
        f.write(raw)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdepot.client.cli", *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60)


def test_a_kept_pool_names_its_address_and_when_it_was_kept(start_daemon, tmp_path):
    pools = tmp_path / "pools"
    pools.mkdir()
    daemon = start_daemon(pool_dir=str(pools))
    path = pool_of(pools, daemon)
    header, _ = kept_pools.read_header(str(path))
    assert header["kept_at"] == 0 and header["lock"] == daemon.socket + ".lock"
    assert kept_pools.served(header["lock"])
    before = time.time()
    daemon.stop()
    header, _ = kept_pools.read_header(str(path))
    assert before <= header["kept_at"] <= time.time()
    assert not kept_pools.served(header["lock"])


def test_a_stale_pool_of_another_address_goes_at_start_and_a_live_ones_stays(start_daemon, tmp_path):
    pools, (gone, live), (stale_pool, live_pool) = two_daemons(start_daemon, tmp_path)
    gone.stop()
    age(stale_pool, 7 * 3600)
    # The live daemon's pool is old by its file's time as well: only its lock keeps it.
    os.utime(live_pool, (time.time() - 8 * 3600,) * 2)
    # Another user's pool file, however old, is that user's daemon's to judge.
    theirs = pools / "kvdepot-0123456789ab-theirs.pool"
    theirs.write_bytes(bytes(8192))
    os.chown(theirs, 65534, 65534)
    os.utime(theirs, (time.time() - 9 * 3600,) * 2)
    third = start_daemon(pool_dir=str(pools))
    assert theirs.exists()
    assert not stale_pool.exists() and not Path(str(stale_pool)[: -len(".pool")] + ".namespaces.json").exists()
    assert live_pool.exists()
    assert f"discarded the pool {stale_pool}" in third.log()
    assert f"unix:{gone.socket}" in third.log() and "--kept-pool-max-age" in third.log()
    assert str(live_pool) not in third.log()


def two_daemons(start_daemon, tmp_path):
    """Two daemons on addresses of their own with their pools in one folder:
    (the folder, the daemons, their pool files)."""
    pools = tmp_path / "pools"
    pools.mkdir()
    daemons = start_daemon(pool_dir=str(pools)), start_daemon(pool_dir=str(pools))
    return pools, daemons, tuple(pool_of(pools, d) for d in daemons)


def test_kept_pools_over_the_cap_go_oldest_first(start_daemon, tmp_path):
    pools, (older, newer), (older_pool, newer_pool) = two_daemons(start_daemon, tmp_path)
    older.stop()
    newer.stop()
    age(older_pool, 120)
    age(newer_pool, 60)
    one_pool = max(older_pool.stat().st_blocks, newer_pool.stat().st_blocks) * 512
    third = start_daemon(pool_dir=str(pools), kept_pools_max_bytes=str(one_pool))
    assert not older_pool.exists() and newer_pool.exists()
    assert "--kept-pools-max-bytes" in third.log()


def test_kvdepot_pools_lists_them_with_address_and_age_and_discards_one(start_daemon, tmp_path):
    pools, (stopped, live), (stopped_pool, live_pool) = two_daemons(start_daemon, tmp_path)
    stopped.stop()
    age(stopped_pool, 600)
    listed = cli("pools", "--pool-dir", str(pools), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["path"]: row for row in json.loads(listed.stdout)}
    assert rows[str(stopped_pool)]["address"] == f"unix:{stopped.socket}"
    assert not rows[str(stopped_pool)]["live"] and 590 <= rows[str(stopped_pool)]["age_seconds"] <= 700
    assert rows[str(live_pool)]["live"]
    table = cli("pools", "--pool-dir", str(pools))
    assert f"unix:{stopped.socket}" in table.stdout and "kept 10 min" in table.stdout
    refused = cli("pools", "--pool-dir", str(pools), "--discard", str(live_pool))
    assert refused.returncode == 1 and "live daemon" in refused.stderr and live_pool.exists()
    done = cli("pools", "--pool-dir", str(pools), "--discard", str(stopped_pool))
    assert done.returncode == 0, done.stderr
    assert not stopped_pool.exists()


def test_the_age_bound_reads_as_an_operator_writes_it():
    from kvdepot.server.daemon.config import ConfigError, load_config

    assert load_config(["--kept-pool-max-age", "30m"], environ={}).lifecycle.kept_pool_max_age == 1800
    assert load_config([], environ={"KVDEPOT_KEPT_POOL_MAX_AGE": "2h"}).lifecycle.kept_pool_max_age == 7200
    assert load_config(["--kept-pool-max-age", "45"], environ={}).lifecycle.kept_pool_max_age == 45
    assert load_config([], environ={}).lifecycle.kept_pool_max_age == 6 * 3600
    with pytest.raises(ConfigError, match="not a duration"):
        load_config(["--kept-pool-max-age", "6 parsecs"], environ={})
