"""Where the pool file goes: the folder (--pool-dir, or beside the socket),
its filesystem and free room, huge pages, and the file's size.

A folder's filesystem decides whether the kernel can pin the pool's pages
(tmpfs, hugetlbfs, ramfs), and what a file of the pool's slots, records and
header takes there."""

from __future__ import annotations

import logging
import os
import stat

from kvdepot.kept_pools import HEADER_BYTES
from kvdepot.pool_parts import is_part_name
from kvdepot.server.host.shard_record import RECORD_BYTES

log = logging.getLogger("kvdepot.pool")


class PoolError(RuntimeError):
    """The pool cannot be created; the message says what to change."""


def pool_file_bytes(num_slots: int, slot_bytes: int, page: int) -> int:
    """The size of a pool file: slots, records and header, in whole pages."""
    end = num_slots * slot_bytes + num_slots * RECORD_BYTES + HEADER_BYTES
    return -(-end // page) * page


def _meminfo(field: str) -> int:
    with open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == field:
                parts = value.split()
                return int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return 0


def huge_page_bytes(directory: str) -> int | None:
    """The page size of a hugetlbfs folder, None for any other filesystem."""
    if filesystem_type(directory) != "hugetlbfs":
        return None
    st = os.statvfs(directory)
    return st.f_bsize or _meminfo("Hugepagesize")


def _free_bytes(directory: str) -> int:
    if huge_page_bytes(directory):
        # hugetlbfs without a size= limit reports no blocks: the pages free in
        # the kernel's pool are what a file there can get.
        st = os.statvfs(directory)
        limit = st.f_bavail * st.f_bsize if st.f_blocks else None
        free = _meminfo("HugePages_Free") * _meminfo("Hugepagesize")
        return free if limit is None else min(limit, free)
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _cgroup_memory_max() -> int | None:
    """This process's cgroup (v2) memory.max in bytes; None where there is none."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
        for line in lines:
            if line.startswith("0::"):
                with open(f"/sys/fs/cgroup{line[3:].rstrip('/')}/memory.max", encoding="utf-8") as f:
                    text = f.read().strip()
                return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None
    return None


def check_memory(directory: str, nbytes: int) -> None:
    """A pool in a memory filesystem (tmpfs, ramfs) is RAM the kernel cannot
    take back once pinned: one larger than the machine's memory, or than the
    cgroup's limit (a container's, charged for the pages it faults in), would
    have the daemon killed part way into bringing it up, its files left behind
    holding memory. Refused; one larger than what is available now, warned of."""
    if filesystem_type(directory) not in ("tmpfs", "ramfs"):
        return
    limit, what = _meminfo("MemTotal"), "the machine's memory (MemTotal)"
    cgroup = _cgroup_memory_max()
    if cgroup is not None and cgroup < limit:
        limit, what = cgroup, "this cgroup's memory limit (memory.max)"
    if limit and nbytes > limit:
        raise PoolError(f"the pool ({nbytes / 2**30:.2f} GiB) is larger than {what}, {limit / 2**30:.2f} GiB: "
                        "lower --pool-size")
    available = _meminfo("MemAvailable")
    if available and nbytes > available:
        log.warning("the pool (%.2f GiB) is larger than the memory available now (MemAvailable, %.2f GiB): the "
                    "kernel may kill a process, this daemon perhaps, to bring it up", nbytes / 2**30,
                    available / 2**30)


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding `path` (tmpfs, hugetlbfs, ext4...), from /proc/self/mounts."""
    path = os.path.realpath(path)
    best, best_type = "", "unknown"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount_point = fields[1].replace("\\040", " ")
                inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fields[2]
    except OSError:
        pass
    return best_type


# The kernel pins (FOLL_LONGTERM) only anonymous and shared-memory pages, so
# cudaHostRegister fails on a pool file in an ordinary disk filesystem.
PINNABLE_FILESYSTEMS = ("tmpfs", "hugetlbfs", "ramfs")


def own_pool_bytes(directory: str, prefix: str) -> int:
    """Bytes of this user's pool files (and their later parts) named
    `prefix`* in `directory`: an earlier daemon's pool, which this one adopts
    or replaces."""
    total = 0
    for name in os.listdir(directory):
        if name.startswith(prefix) and (name.endswith(".pool") or is_part_name(name)):
            try:
                st = os.lstat(os.path.join(directory, name))
            except OSError:
                continue
            if st.st_uid == os.geteuid() and stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512
    return total


def pool_folders(setting: str, socket_dir: str | None) -> list[str]:
    """The folders a pool file may be in: the configured one, or those `auto` picks from."""
    if setting != "auto":
        return [setting]
    return [d for d in ("/dev/shm", socket_dir, "/tmp") if d and os.path.isdir(d)]


def choose_pool_dir(setting: str, socket_dir: str | None, size: int, prefix: str = "") -> str:
    """The folder for the pool file: the configured one, or the first with room
    (counting the room the pool an earlier daemon left there takes)."""
    if setting != "auto":
        if not os.path.isdir(setting):
            raise PoolError(f"pool_dir {setting} is not a folder")
        return setting
    candidates = pool_folders(setting, socket_dir)
    for directory in candidates:
        if _free_bytes(directory) + (own_pool_bytes(directory, prefix) if prefix else 0) >= size:
            return directory
    seen = ", ".join(f"{d} has {_free_bytes(d) / 2**30:.1f} GiB free" for d in candidates)
    raise PoolError(
        f"the pool ({size / 2**30:.1f} GiB) fits nowhere: {seen}. Lower --pool-size, "
        "give the container a larger /dev/shm (docker --shm-size, or an emptyDir with "
        "medium: Memory in Kubernetes), or set --pool-dir to a tmpfs or hugetlbfs with room."
    )


def _pin_hint(directory: str) -> str:
    fs_type = filesystem_type(directory)
    if fs_type in PINNABLE_FILESYSTEMS:
        return ""
    return (f": the pool is in {directory}, a {fs_type} filesystem, and the kernel pins only shared-memory "
            "pages; set --pool-dir to /dev/shm, a tmpfs or a hugetlbfs mount")
