"""The machine's NUMA topology, read from sysfs, and the placement of memory on it.

On a machine of two CPU sockets each socket has its own memory and its own
PCIe root complexes, and half the GPUs hang off each. A GPU's DMA into memory
of the other socket crosses the socket link (UPI, Infinity Fabric). So the
pool is carved into one range of slots per NUMA node (carving.py), each
range's pages are placed on its node (mbind, before they are faulted in), and
a GPU's stores take slots of its own node.

What is read: /sys/devices/system/node/has_memory (the nodes with memory),
each GPU's /sys/bus/pci/devices/<address>/numa_node (-1: the firmware does
not say), and, for stats, which PCI devices are GPUs. sysfs is the kernel's,
but a container may mount something else there: every file is read bounded
and parsed strictly, and whatever does not parse counts as unknown. Placement
is a hint: nothing here ever stops the daemon.

SYSFS_ROOT is where sysfs is; the tests point it at a fake tree (their
launcher, tests/daemon_with_numa.py), never a setting of the daemon.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger("kvdepot.numa")

SYSFS_ROOT = "/sys"

# Nodes the pool may be carved over, and the highest node id taken: the
# largest machines have a few dozen nodes, and the kernel's default limit is 1024.
MAX_NODES = 64
MAX_NODE_ID = 1023
# PCI devices looked at for GPUs, and GPUs listed; bytes read of a sysfs file.
MAX_PCI_DEVICES = 4096
MAX_GPUS = 64
MAX_FILE_BYTES = 4096

_PCI_VENDOR_NVIDIA = "0x10de"
# PCI class 0x03: display controllers (0x0300 VGA, 0x0302 3D: data-centre GPUs).
_PCI_CLASS_DISPLAY = "0x03"

_PCI_ADDRESS = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")


@dataclass(frozen=True)
class Placement:
    """Where the pool goes: the nodes it is carved over (none: one undivided
    pool), the memory nodes sysfs shows, and the GPUs on each node (PCI
    addresses; node -1 holds those whose node is unknown)."""

    nodes: tuple[int, ...] = ()
    detected: tuple[int, ...] = ()
    gpus: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def all_gpus(self) -> tuple[str, ...]:
        return tuple(sorted(g for gpus in self.gpus.values() for g in gpus))


# ------------------------------------------------------------ reading sysfs


def _root(root: str | None) -> str:
    return root if root is not None else SYSFS_ROOT


def _read(path: str) -> str | None:
    """A small sysfs file's text, stripped; None when it is missing, too
    large or not text."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_FILE_BYTES:
        return None
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        return None


def parse_node_list(text: str) -> tuple[int, ...]:
    """A node list as sysfs and --numa write it ("0", "0,1", "0-3,8"): sorted,
    without repeats; ValueError for anything else, for an id past
    MAX_NODE_ID or for more than MAX_NODES nodes."""
    nodes: set[int] = set()
    text = text.strip()
    if not text:
        raise ValueError("an empty list of NUMA nodes")
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d{1,4})\s*(?:-\s*(\d{1,4})\s*)?", part)
        if not match:
            raise ValueError(f"{part.strip()!r} is not a NUMA node or a range of them (like 0 or 0-3)")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first or last > MAX_NODE_ID:
            raise ValueError(f"{part.strip()!r}: NUMA nodes go from 0 to {MAX_NODE_ID}, a range upwards")
        nodes.update(range(first, last + 1))
        if len(nodes) > MAX_NODES:
            raise ValueError(f"more than {MAX_NODES} NUMA nodes")
    return tuple(sorted(nodes))


def memory_nodes(root: str | None = None) -> tuple[int, ...]:
    """The NUMA nodes that have memory; () when sysfs does not say (no NUMA,
    or no sysfs): one node, as far as placement goes."""
    text = _read(os.path.join(_root(root), "devices/system/node/has_memory"))
    if text is None:
        return ()
    try:
        return parse_node_list(text)
    except ValueError as e:
        log.warning("NUMA: cannot read the nodes with memory from sysfs (%s); placing nothing", e)
        return ()


def pci_address(text: str | None) -> str | None:
    """A PCI address as sysfs names it (0000:3b:00.0), from the forms CUDA
    and NVML write (0000:3B:00.0, 00000000:3B:00.0); None if it is not one."""
    match = _PCI_ADDRESS.fullmatch(text.strip()) if text else None
    if not match:
        return None
    domain, bus, device, function = (int(g, 16) if g else 0 for g in match.groups())
    if domain > 0xFFFF or device > 0x1F:
        return None
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function}"


def device_node(address: str | None, root: str | None = None) -> int | None:
    """The NUMA node of the PCI device at `address`; None when unknown (-1 in
    sysfs: a machine of one node, or firmware that does not say)."""
    address = pci_address(address)
    if address is None:
        return None
    text = _read(os.path.join(_root(root), "bus/pci/devices", address, "numa_node"))
    if text is None or not re.fullmatch(r"-?\d{1,4}", text):
        return None
    node = int(text)
    return node if 0 <= node <= MAX_NODE_ID else None


def gpus_by_node(root: str | None = None) -> dict[int, tuple[str, ...]]:
    """NVIDIA GPUs (display controllers) by NUMA node (-1: unknown), at most
    MAX_GPUS of the first MAX_PCI_DEVICES PCI devices."""
    folder = os.path.join(_root(root), "bus/pci/devices")
    try:
        with os.scandir(folder) as entries:
            names = []
            for entry in entries:
                names.append(entry.name)
                if len(names) >= MAX_PCI_DEVICES:
                    break
    except OSError:
        return {}
    found: dict[int, list[str]] = {}
    count = 0
    for name in sorted(names):
        address = pci_address(name)
        if address != name:
            continue
        vendor = _read(os.path.join(folder, name, "vendor"))
        klass = _read(os.path.join(folder, name, "class"))
        if vendor != _PCI_VENDOR_NVIDIA or klass is None or not klass.startswith(_PCI_CLASS_DISPLAY):
            continue
        node = device_node(address, root)
        found.setdefault(-1 if node is None else node, []).append(address)
        count += 1
        if count >= MAX_GPUS:
            break
    return {node: tuple(gpus) for node, gpus in sorted(found.items())}


def placement(setting: str, root: str | None = None) -> Placement:
    """The placement --numa asks for: `auto` carves the pool over the memory
    nodes when there are two or more, `off` never carves it, a list of nodes
    carves it over those (trusted: the operator knows the machine)."""
    detected = memory_nodes(root)
    gpus = gpus_by_node(root)
    if setting == "off":
        nodes: tuple[int, ...] = ()
    elif setting == "auto":
        nodes = detected if len(detected) > 1 else ()
    else:
        nodes = parse_node_list(setting)
    return Placement(nodes, detected, gpus)


# ------------------------------------------------------------ placing memory

# mbind(2) has no wrapper in glibc (libnuma has one): the raw system call.
_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259, "s390x": 268}
# Preferred, not bound: a node short of memory gets its pages from another
# node rather than failing the fault-in (placement is a hint).
_MPOL_PREFERRED = 1
_MASK_WORDS = (MAX_NODE_ID + 1) // (8 * ctypes.sizeof(ctypes.c_ulong))

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def bind(address: int, length: int, node: int) -> int:
    """Asks the kernel to place the pages of [address, address + length) on
    `node` when they are faulted in; 0, or the errno of its refusal (EPERM
    where a container's seccomp refuses mbind, EINVAL for a node it has not)."""
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        return errno.ENOSYS
    if not 0 <= node <= MAX_NODE_ID:
        return errno.EINVAL
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask[node // bits] = 1 << (node % bits)
    # maxnode: the kernel reads one bit fewer than it is told (as libnuma passes it).
    rc = _libc.syscall(
        ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_ulong(length), ctypes.c_long(_MPOL_PREFERRED),
        mask, ctypes.c_ulong(_MASK_WORDS * bits + 1), ctypes.c_uint(0),
    )
    if rc == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def bind_ranges(base: int, ranges: Sequence[tuple[int, int, int]], page: int) -> dict[int, bool]:
    """Places each (node, offset, length) range of the mapping at `base`,
    its ends rounded down to whole pages (a page that two ranges share goes
    to the second); {node: placed}. A refusal is logged once and changes nothing
    else."""
    placed: dict[int, bool] = {}
    refused = []
    for node, offset, length in ranges:
        start = offset // page * page
        end = (offset + length) // page * page
        if end <= start:
            placed[node] = False
            continue
        code = bind(base + start, end - start, node)
        placed[node] = code == 0
        if code:
            refused.append(f"node {node}: {os.strerror(code)}")
    if refused:
        log.warning(
            "NUMA: the kernel did not place the pool's ranges on their nodes (%s); the pool works, its pages "
            "go where the kernel puts them (a container may need CAP_SYS_NICE for mbind)", "; ".join(refused)
        )
    return placed
