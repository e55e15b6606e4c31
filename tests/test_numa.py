"""NUMA placement of the pool (docs/operations.md, "NUMA"), on a simulated
two-socket machine: a fake sysfs tree, read by the real daemon through
tests/daemon_with_numa.py. The machines the tests run on have one node."""

from __future__ import annotations

import ctypes
import json
import mmap
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env
from kvcache import block_of, make_kv_cache, namespace, prompt_keys
from prometheus_client.parser import text_string_to_metric_families

from kvdepot.server.daemon.config import ConfigError, load_config
from kvdepot.server.host import numa
from kvdepot.server.host.carving import SlotRange, carve
from kvdepot.server.host.free_runs import FreeRuns
from kvdepot.server.host.pool import HostPool, PoolError

LAUNCHER = str(Path(__file__).with_name("daemon_with_numa.py"))
NVIDIA, GPU_CLASS = "0x10de", "0x030200"
# A two-socket HGX node: four GPUs and a NIC per socket, and an NVSwitch (not a GPU).
TWO_SOCKETS = {
    "0000:18:00.0": (NVIDIA, GPU_CLASS, "0"),
    "0000:2a:00.0": (NVIDIA, GPU_CLASS, "0"),
    "0000:17:00.0": ("0x15b3", "0x020000", "0"),
    "0000:9a:00.0": (NVIDIA, GPU_CLASS, "1"),
    "0000:ab:00.0": (NVIDIA, GPU_CLASS, "1"),
    "0000:99:00.0": ("0x15b3", "0x020000", "1"),
    "0000:05:00.0": (NVIDIA, "0x068000", "0"),
}


def fake_sysfs(root: Path, has_memory: str = "0-1", devices: dict | None = None) -> Path:
    nodes = root / "devices/system/node"
    nodes.mkdir(parents=True)
    (nodes / "has_memory").write_text(has_memory + "\n")
    for node in numa.parse_node_list(has_memory):
        (nodes / f"node{node}").mkdir()
        (nodes / f"node{node}" / "meminfo").write_text(f"Node {node} MemTotal:  1048576 kB\n")
    pci = root / "bus/pci/devices"
    pci.mkdir(parents=True)
    for address, (vendor, klass, node) in (TWO_SOCKETS if devices is None else devices).items():
        (pci / address).mkdir()
        (pci / address / "vendor").write_text(vendor + "\n")
        (pci / address / "class").write_text(klass + "\n")
        (pci / address / "numa_node").write_text(node + "\n")
    return root


# ------------------------------------------------------------ detection


def test_detection_reads_a_two_socket_tree(tmp_path):
    root = str(fake_sysfs(tmp_path / "sys"))
    assert numa.memory_nodes(root) == (0, 1)
    assert numa.gpus_by_node(root) == {0: ("0000:18:00.0", "0000:2a:00.0"), 1: ("0000:9a:00.0", "0000:ab:00.0")}
    # A GPU's node from the PCI address CUDA (or NVML) writes.
    assert numa.device_node("0000:9A:00.0", root) == 1
    assert numa.device_node("00000000:9A:00.0", root) == 1
    assert numa.device_node("0000:18:00.0", root) == 0
    assert numa.device_node("0000:42:00.0", root) is None  # no such device
    placed = numa.placement("auto", root)
    assert placed.nodes == (0, 1) and placed.detected == (0, 1)


def test_detection_takes_nonsense_as_unknown(tmp_path):
    root = tmp_path / "sys"
    fake_sysfs(root, devices={
        "0000:01:00.0": (NVIDIA, GPU_CLASS, "-1"),        # the firmware does not say
        "0000:02:00.0": (NVIDIA, GPU_CLASS, "seven"),
        "0000:03:00.0": (NVIDIA, GPU_CLASS, "99999"),
        "0000:04:00.0": (NVIDIA, GPU_CLASS, "1" * 5000),  # past what is read
        "not-a-device": (NVIDIA, GPU_CLASS, "0"),
    })
    assert numa.gpus_by_node(str(root)) == {-1: ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0")}
    for address in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0", "../../../etc/passwd",
                    "0000:01:00.0/../../..", "", None, "0000:01:00.9", "1ffff:01:00.0"):
        assert numa.device_node(address, str(root)) is None, address
    for has_memory in ("garbage", "0-99999", "3-1", "\xff", "0," * 3000):
        (root / "devices/system/node/has_memory").write_text(has_memory)
        assert numa.memory_nodes(str(root)) == (), has_memory
    assert numa.placement("auto", str(root)).nodes == ()
    # No sysfs at all: nothing known, nothing placed.
    assert numa.memory_nodes(str(tmp_path / "none")) == () and numa.gpus_by_node(str(tmp_path / "none")) == {}


def test_node_lists_parse_strictly():
    assert numa.parse_node_list("0") == (0,)
    assert numa.parse_node_list(" 1,0, 1 ") == (0, 1)
    assert numa.parse_node_list("0-3,8") == (0, 1, 2, 3, 8)
    for bad in ("", "a", "-1", "3-1", "1024", "0-64", "0,,1", "0-1-2", "1e3"):
        with pytest.raises(ValueError):
            numa.parse_node_list(bad)


def test_the_option_takes_auto_off_or_a_list(tmp_path):
    assert load_config(["--numa", "0-1"], environ={}).pool.numa == "0-1"
    assert load_config([], environ={}).pool.numa == "auto"
    for bad in ("on", "0,x", "0-99999"):
        with pytest.raises(ConfigError, match="numa must be auto, off or a list"):
            load_config(["--numa", bad], environ={})


def test_placement_follows_the_setting(tmp_path):
    two = str(fake_sysfs(tmp_path / "two"))
    one = str(fake_sysfs(tmp_path / "one", has_memory="0", devices={}))
    assert numa.placement("auto", two).nodes == (0, 1)
    assert numa.placement("off", two).nodes == ()
    assert numa.placement("1", two).nodes == (1,)
    assert numa.placement("auto", one).nodes == () and numa.placement("auto", one).detected == (0,)


# ------------------------------------------------------------ the free slots


def test_free_runs_take_the_nodes_own_range_then_the_emptiest():
    assert carve(10, (0, 1, 3)) == [SlotRange(0, 0, 4), SlotRange(1, 4, 3), SlotRange(3, 7, 3)]
    with pytest.raises(ValueError):
        carve(1, (0, 1))
    free = FreeRuns(8, (0, 1), extent_slots=1)
    assert [free.allocate(1) for _ in range(4)] == [4, 5, 6, 7]   # node 1's range, lowest first
    assert free.allocate(1) == 0                                   # full: spills to node 0
    assert free.allocate(7) == 1                                   # a node the pool is not carved over: any
    assert free.allocate(None) == 2
    free.release(5)
    assert free.free_in(1) == 1 and free.allocate(None) == 3      # node 0 has more free (1 against 1: the first)
    assert free.allocate(None) == 5 and free.allocate(0) is None and free.free == 0
    free.release(0)
    assert free.allocate(1) == 0
    assert FreeRuns(4).allocate(1) == 0                             # not carved: one range of no node
    kept = FreeRuns(8, (0, 1), extent_slots=1)
    assert kept.keep_only({0: 1, 4: 1, 5: 1}) == [(1, 1), (2, 1), (3, 1), (6, 1), (7, 1)] and kept.free == 5
    assert kept.allocate(1) == 6


def test_the_pool_carves_its_slots_and_places_each_range(tmp_path):
    placement = numa.Placement(nodes=(0, 1), detected=(0, 1), gpus={1: ("0000:9a:00.0",)})
    pool = HostPool(size=16 * 4096, slot_bytes=4096, directory=str(tmp_path), name="numa", pin="off",
                    placement=placement)
    try:
        assert [pool.allocate(1) for _ in range(9)] == [*range(8, 16), 0]
        nodes = pool.numa_nodes()
        assert [(n.node, n.first_slot, n.slots, n.used_slots, n.gpus) for n in nodes] == [
            (0, 0, 8, 1, ()), (1, 8, 8, 8, ("0000:9a:00.0",))
        ]
        # This machine has no node 1: the kernel refuses it (logged), the pool works.
        if 1 not in numa.memory_nodes():
            assert pool.bound[1] is False and nodes[1].bound is False
        pool.release(9)
        assert pool.used_slots == 8 and pool.allocate(1) == 9
    finally:
        pool.close(discard=True)
    with pytest.raises(PoolError, match="cannot be carved over 2 NUMA nodes"):
        HostPool(size=4096, slot_bytes=4096, directory=str(tmp_path), name="tiny", pin="off", placement=placement)


def test_binding_a_node_the_kernel_lacks_is_refused_not_fatal():
    buffer = mmap.mmap(-1, 1 << 16)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert numa.bind(address, 4096, numa.MAX_NODE_ID + 1) != 0
    assert numa.bind_ranges(address, [(numa.MAX_NODE_ID, 0, 8192)], mmap.PAGESIZE) == {numa.MAX_NODE_ID: False}


# ------------------------------------------------------------ the daemon


def cli_stats(daemon, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdepot.client.cli", "--socket", daemon.socket, "stats", *args],
                          capture_output=True, text=True, env=subprocess_env(), timeout=60)


def node_use(client) -> dict[int, int]:
    return {n.node: n.used_slots for n in client.stats().numa_nodes}


def scrape(daemon) -> dict:
    url = re.search(r"serving Prometheus metrics at (\S+)", daemon.log()).group(1)
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_workers_stores_take_its_nodes_slots_then_spill(start_daemon, client_factory, tmp_path):
    sysfs = fake_sysfs(tmp_path / "sys")
    # 16 slots of 16 KiB: node 0 has slots 0-7, node 1 slots 8-15.
    daemon = start_daemon(launcher=LAUNCHER, env={"KVDEPOT_TEST_SYSFS": str(sysfs)}, numa="0,1",
                          pool_size="256KiB", metrics_listen="127.0.0.1:0")
    ns = namespace("per_layer")
    near = client_factory(daemon, name="on-node-1")
    tensors, block_dim = make_kv_cache("per_layer", seed=11)
    worker = near.register_worker(ns, rank=0, tensors=tensors, block_dim=block_dim, device="numa1")
    engine = near.register_engine(ns)
    keys = prompt_keys(11, prompt=40)

    job = near.submit_store(worker, 1, keys[:6], list(range(6)))
    assert near.wait([job], 10)[job].ok
    assert node_use(near) == {0: 0, 1: 6}
    job = near.submit_store(worker, 2, keys[6:], list(range(6, 11)))  # two fit on node 1, three spill
    assert near.wait([job], 10)[job].ok
    assert node_use(near) == {0: 3, 1: 8}

    # A worker of no node takes the node with the most free slots.
    anywhere = client_factory(daemon, name="no-node")
    other, other_block_dim = make_kv_cache("per_layer", seed=12)
    cpu_worker = anywhere.register_worker(ns, rank=0, tensors=other, block_dim=other_block_dim)
    job = anywhere.submit_store(cpu_worker, 1, prompt_keys(2, prompt=41), [0, 1])
    assert anywhere.wait([job], 10)[job].ok
    assert node_use(near) == {0: 5, 1: 8}

    # Loads read wherever the blocks are: both ranges, bit for bit.
    assert near.lookup(engine, keys).ready_blocks == 11
    job = near.submit_load(worker, 3, keys, list(range(100, 111)))
    assert near.wait([job], 10)[job].ok
    for i in range(11):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 100 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16)), f"block {i} differs"

    stats = json.loads(cli_stats(daemon, "--json").stdout)
    assert stats["numa_carved"] is True
    assert [(n["node"], n["first_slot"], n["slots"], n["used_slots"], n["gpus"]) for n in stats["numa_nodes"]] == [
        (0, 0, 8, 5, ["0000:18:00.0", "0000:2a:00.0"]), (1, 8, 8, 8, ["0000:9a:00.0", "0000:ab:00.0"])
    ]
    table = cli_stats(daemon).stdout
    assert "numa      node 0: slots 0-7, 5 used (62.5%)" in table
    assert "numa      node 1: slots 8-15, 8 used (100.0%)" in table and "GPUs 0000:9a:00.0, 0000:ab:00.0" in table
    samples = scrape(daemon)
    assert samples["kvdepot_numa_node_slots", frozenset({("node", "1")})] == 8
    assert samples["kvdepot_numa_node_used_slots", frozenset({("node", "0")})] == 5
    assert samples["kvdepot_numa_node_gpu", frozenset({("node", "1"), ("pci", "0000:ab:00.0")})] == 1
    assert ("kvdepot_numa_node_bound", frozenset({("node", "0")})) in samples
    assert "NUMA node 1: slots 8-15" in daemon.log()


def test_auto_carves_a_two_node_machine_and_not_a_one_node_one(start_daemon, tmp_path):
    two = fake_sysfs(tmp_path / "two")
    one = fake_sysfs(tmp_path / "one", has_memory="0", devices={"0000:18:00.0": (NVIDIA, GPU_CLASS, "-1")})
    cases = [
        (two, "auto", True, [(0, 0, 8), (1, 8, 8)]),
        (two, "off", False, [(-1, 0, 16)]),
        (one, "auto", False, [(0, 0, 16)]),
    ]
    for sysfs, setting, carved, nodes in cases:
        daemon = start_daemon(launcher=LAUNCHER, env={"KVDEPOT_TEST_SYSFS": str(sysfs)}, numa=setting,
                              pool_size="256KiB")
        proc = cli_stats(daemon, "--json")
        assert proc.returncode == 0, proc.stderr
        stats = json.loads(proc.stdout)
        assert stats["numa_carved"] is carved, setting
        assert [(n["node"], n["first_slot"], n["slots"]) for n in stats["numa_nodes"]] == nodes
        table = cli_stats(daemon).stdout
        if sysfs is one:  # what the one-node device machines show
            assert "numa      pool not carved: one memory node (0); GPUs 0000:18:00.0" in table
        daemon.stop()


def test_gpus_on_no_node_of_the_pool_are_still_shown(start_daemon, tmp_path):
    """A GPU whose node --numa leaves out, or that sysfs puts on no node, has
    no range of its own: stats, metrics and the log still name it."""
    devices = {**TWO_SOCKETS, "0000:db:00.0": (NVIDIA, GPU_CLASS, "-1")}
    sysfs = fake_sysfs(tmp_path / "sys", devices=devices)
    daemon = start_daemon(launcher=LAUNCHER, env={"KVDEPOT_TEST_SYSFS": str(sysfs)}, numa="0",
                          pool_size="256KiB", metrics_listen="127.0.0.1:0")
    stats = json.loads(cli_stats(daemon, "--json").stdout)
    assert stats["numa_carved"] is True
    assert [(n["node"], n["gpus"]) for n in stats["numa_nodes"]] == [(0, ["0000:18:00.0", "0000:2a:00.0"])]
    assert stats["numa_gpus_elsewhere"] == ["0000:9a:00.0", "0000:ab:00.0", "0000:db:00.0"]
    table = cli_stats(daemon).stdout
    assert "on no node of the pool (stores take the range with the most free slots): GPUs 0000:9a:00.0, " \
           "0000:ab:00.0, 0000:db:00.0" in table
    samples = scrape(daemon)
    assert samples["kvdepot_numa_node_gpu", frozenset({("node", "1"), ("pci", "0000:ab:00.0")})] == 1
    assert samples["kvdepot_numa_node_gpu", frozenset({("node", "unknown"), ("pci", "0000:db:00.0")})] == 1
    assert "NUMA: GPUs on no node of the pool" in daemon.log()
    daemon.stop()

    # Not carved: every GPU by its own node in the metrics, and a line in the log.
    daemon = start_daemon(launcher=LAUNCHER, env={"KVDEPOT_TEST_SYSFS": str(sysfs)}, numa="off",
                          pool_size="256KiB", metrics_listen="127.0.0.1:0")
    samples = scrape(daemon)
    assert samples["kvdepot_numa_node_gpu", frozenset({("node", "0"), ("pci", "0000:18:00.0")})] == 1
    assert samples["kvdepot_numa_node_gpu", frozenset({("node", "1"), ("pci", "0000:9a:00.0")})] == 1
    assert "NUMA: pool not carved (several memory nodes, or none known); GPUs: 0000:18:00.0" in daemon.log()
    assert json.loads(cli_stats(daemon, "--json").stdout).get("numa_gpus_elsewhere", []) == []
