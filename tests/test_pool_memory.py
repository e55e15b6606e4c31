"""A pool in a memory filesystem larger than the memory it may have is
refused before it is made (the kernel would kill the daemon part way into
bringing it up, and its files would go on holding memory); one larger than
what is available now is warned of."""

from __future__ import annotations

import logging

import pytest

from kvdepot.server.host import pool_folder
from kvdepot.server.host.pool_folder import PoolError, check_memory

GiB = 1 << 30


@pytest.fixture
def machine(monkeypatch):
    """A machine of 16 GiB, 12 available, whose folders are what the test says."""
    state = {"MemTotal": 16 * GiB, "MemAvailable": 12 * GiB, "cgroup": None, "fs": "tmpfs"}
    monkeypatch.setattr(pool_folder, "_meminfo", lambda field: state.get(field, 0))
    monkeypatch.setattr(pool_folder, "_cgroup_memory_max", lambda: state["cgroup"])
    monkeypatch.setattr(pool_folder, "filesystem_type", lambda path: state["fs"])
    return state


def test_a_pool_larger_than_the_machines_memory_is_refused(machine):
    with pytest.raises(PoolError, match=r"larger than the machine's memory \(MemTotal\), 16.00 GiB: lower --pool-size"):
        check_memory("/dev/shm", 20 * GiB)


def test_a_containers_limit_is_the_limit_where_lower(machine):
    machine["cgroup"] = 4 * GiB
    with pytest.raises(PoolError, match=r"this cgroup's memory limit \(memory.max\), 4.00 GiB"):
        check_memory("/dev/shm", 6 * GiB)
    check_memory("/dev/shm", 3 * GiB)


def test_more_than_is_available_now_is_warned_of_and_served(machine, caplog):
    with caplog.at_level(logging.WARNING):
        check_memory("/dev/shm", 14 * GiB)
    assert "larger than the memory available now (MemAvailable, 12.00 GiB)" in caplog.text


def test_a_folder_on_disk_is_not_memory(machine):
    machine["fs"] = "ext4"
    check_memory("/var/lib/kvdepot", 20 * GiB)


def test_the_real_machine_refuses_a_pool_past_its_memory(tmp_path):
    """Without stand-ins: this machine's own MemTotal, in its /dev/shm."""
    total = pool_folder._meminfo("MemTotal")
    if pool_folder.filesystem_type("/dev/shm") != "tmpfs" or not total:
        pytest.skip("no tmpfs /dev/shm here")
    with pytest.raises(PoolError, match="lower --pool-size"):
        check_memory("/dev/shm", total + GiB)
