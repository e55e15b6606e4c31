"""The host pool: one shared-memory file, carved into fixed-size slots.

With CUDA the pool is registered as pinned memory so that the GPU copies to
and from it by DMA. Faulting in (and pinning) hundreds of GB is slow, so it
runs in chunks on several threads and reports progress.

The file outlives the daemon, so that the next one can adopt its blocks
(tiers/warm.py). After the slots come one record per slot (host/shard_record.py)
and, in the file's last page, a header that says how the file is laid out:

    [slot 0 | slot 1 | ... | record 0 | record 1 | ... | padding | header]
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import mmap
import os
import stat
import time
from collections.abc import Callable

from kvdepot.kept_pools import HEADER_BYTES, pack_header
from kvdepot.keys import KEY_VERSION
from kvdepot.server.host import numa
from kvdepot.server.host.free_slots import FreeSlots, NodeSlots
from kvdepot.server.host.own_files import open_own
from kvdepot.server.host.shard_record import FORMAT_VERSION, RECORD_BYTES

log = logging.getLogger("kvdepot.pool")

# Faulted in this much at a time, by several threads.
POPULATE_CHUNK_BYTES = 256 << 20

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2

# madvise(MADV_POPULATE_WRITE), Linux 5.14: faults in a range writable.
_MADV_POPULATE_WRITE = 23
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class PoolError(RuntimeError):
    """The pool cannot be created; the message says what to change."""


_EMPTY_RECORD = bytes(RECORD_BYTES)


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
    """Bytes of this user's pool files named `prefix`* in `directory`: an
    earlier daemon's pool, which this one adopts or replaces."""
    total = 0
    for name in os.listdir(directory):
        if name.startswith(prefix) and name.endswith(".pool"):
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


class HostPool:
    def __init__(
        self,
        *,
        size: int,
        slot_bytes: int,
        directory: str,
        name: str,
        pin: str = "auto",
        threads: int = 0,
        pin_chunk_bytes: int = 1 << 30,
        progress: Callable[[str], None] | None = None,
        adopt: bool = False,
        address: str = "",
        lock_path: str = "",
        placement: numa.Placement | None = None,
    ):
        """A new pool file `name`.pool in `directory`; with `adopt`, the one
        already there (read_header must have accepted it for this layout).
        Its header names `address` and the `lock_path` its daemon holds, so
        that a kept pool shows whose it is and whether a daemon serves it.
        With a `placement` of NUMA nodes, the slots are carved over them."""
        self.address = address
        self.lock_path = lock_path
        self.slot_bytes = slot_bytes
        # Pinned in registrations of whole slots, so that no slot straddles two.
        self.registration_bytes = max(1, pin_chunk_bytes // slot_bytes) * slot_bytes
        self.num_slots = size // slot_bytes
        self.size = self.num_slots * slot_bytes
        self.huge_pages = huge_page_bytes(directory)
        # A hugetlbfs file is a whole number of huge pages.
        self._file_size = pool_file_bytes(self.num_slots, slot_bytes, self.huge_pages or mmap.PAGESIZE)
        self.path = os.path.join(directory, f"{name}.pool")
        self.adopted = adopt
        self.pinned = False
        self.pin_seconds = 0.0
        self._registered: list[int] = []
        self._cudart = None
        self._progress = progress or log.info
        self._threads = threads or min(16, os.cpu_count() or 1)
        self.placement = placement or numa.Placement()
        try:
            self.slots = FreeSlots(self.num_slots, self.placement.nodes)
        except ValueError as e:
            raise PoolError(f"{e}: raise --pool-size or list fewer nodes in --numa") from None
        # {node: whether the kernel took the placement of its range}.
        self.bound: dict[int, bool] = {}
        # Bumped whenever a slot is released: a record sealed for an older use
        # of the slot is not written (tiers/warm.py).
        self.epochs = [0] * self.num_slots
        if not adopt and self._file_size > _free_bytes(directory):
            what = "huge pages free (HugePages_Free in /proc/meminfo)" if self.huge_pages else "free"
            raise PoolError(
                f"the pool ({self._file_size / 2**30:.2f} GiB) does not fit in {directory} "
                f"({_free_bytes(directory) / 2**30:.2f} GiB {what})"
            )
        # The daemon's user alone: the pool holds every tenant's KV, and a
        # process that maps it could read or overwrite any of it.
        # Checked again on the descriptor: a name in /dev/shm can change hands
        # between read_header and here.
        fd = open_own(self.path, os.O_RDWR if adopt else os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            if not adopt:
                os.ftruncate(fd, self._file_size)
            self.buffer = mmap.mmap(fd, self._file_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._base = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
            self._place()
            self._fault_in(fd)
            self.records = memoryview(self.buffer)[self.size : self.size + self.num_slots * RECORD_BYTES]
            self._write_header(kept_at=0.0)  # served again, if adopted
        except BaseException:
            os.close(fd)
            if not adopt:
                os.unlink(self.path)
            raise
        os.close(fd)
        if pin != "off":
            self._pin(required=(pin == "on"))

    def _write_header(self, kept_at: float) -> None:
        header = pack_header(FORMAT_VERSION, KEY_VERSION, self.slot_bytes, self.num_slots, self._file_size,
                             self.address, self.lock_path, kept_at)
        at = self._file_size - HEADER_BYTES
        self.buffer[at : at + len(header)] = header

    # ------------------------------------------------------------ start-up

    def _place(self) -> None:
        """Each node's range of slots goes on its node: asked before the
        pages are faulted in (a kept pool's pages stay where they are)."""
        if self.slots.carved:
            ranges = [(r.node, r.first * self.slot_bytes, r.count * self.slot_bytes) for r in self.slots.ranges]
            self.bound = numa.bind_ranges(self._base, ranges, self.huge_pages or mmap.PAGESIZE)

    def _run_chunks(self, what: str, work: Callable[[int, int], None], chunk: int, threads: int) -> float:
        start = time.monotonic()
        total = self._file_size
        chunks = [(off, min(chunk, total - off)) for off in range(0, total, chunk)]
        done = 0
        # MiB for small pools, which would read "0.0 of 0.0 GiB".
        unit, scale = ("GiB", 2**30) if self.size >= 2**30 else ("MiB", 2**20)

        def report() -> None:
            # In the pool's bytes, as configured: the file's records and header
            # (under 1% of it) would make 64 GiB read 64.5.
            shown = done * self.size / total
            self._progress(f"{what}: {shown / scale:.1f} of {self.size / scale:.1f} {unit} ({100 * done / total:.0f}%)")

        # At once, so that an operator waiting on a large pool sees what it does.
        report()
        last_report = start
        with concurrent.futures.ThreadPoolExecutor(threads) as executor:
            for length in executor.map(lambda c: (work(*c), c[1])[1], chunks):
                done += length
                now = time.monotonic()
                if now - last_report >= 1.0 or done == total:
                    report()
                    last_report = now
        return time.monotonic() - start

    def _fault_in(self, fd: int) -> None:
        """Allocates every page of the pool now, on several threads.

        Page faults of one tmpfs file proceed in parallel (fallocate would
        serialise on the file's lock), and a pool that does not fit fails here
        with a clear error instead of SIGBUS on a later copy. Populated page
        tables also make the CUDA registration that follows several times
        faster.
        """
        directory = os.path.dirname(self.path)

        def populate(offset: int, length: int) -> None:
            if _LIBC.madvise(ctypes.c_void_p(self._base + offset), ctypes.c_size_t(length), _MADV_POPULATE_WRITE):
                code = ctypes.get_errno()
                if code == errno.EINVAL:  # kernels before 5.14
                    os.posix_fallocate(fd, offset, length)
                    return
                raise PoolError(
                    f"could not allocate the pool in {directory} ({os.strerror(code)}): lower "
                    "--pool-size or set --pool-dir to a tmpfs with room"
                )

        chunk = POPULATE_CHUNK_BYTES
        if self.huge_pages:
            chunk = max(1, chunk // self.huge_pages) * self.huge_pages
        what = "mapping the kept pool" if self.adopted else "allocating the pool"
        seconds = self._run_chunks(what, populate, chunk, self._threads)
        pages = f"{self.huge_pages >> 20} MiB huge pages" if self.huge_pages else "4 KiB pages"
        log.info("pool of %.2f GiB allocated in %.2f s at %s (%s)", self.size / 2**30, seconds, self.path, pages)

    def _pin(self, required: bool) -> None:
        try:
            import torch
        except ImportError:
            torch = None
        if torch is None or not torch.cuda.is_available():
            if required:
                raise PoolError("--pin on needs CUDA, and this machine has none")
            log.info("CUDA not available: the pool is not pinned")
            return
        cudart = torch.cuda.cudart()
        registered: list[int] = []
        directory = os.path.dirname(self.path)
        fs_type = filesystem_type(directory)

        def register(offset: int, length: int) -> None:
            # Portable: usable from every GPU's context; mapped: its host pointers
            # are valid in kernels (UVA), which the copy kernel relies on.
            rc = cudart.cudaHostRegister(self._base + offset, length, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
            if int(rc) != 0:
                hint = ""
                if fs_type not in PINNABLE_FILESYSTEMS:
                    hint = (
                        f": the pool is in {directory}, a {fs_type} filesystem, and the kernel "
                        "pins only shared-memory pages; set --pool-dir to /dev/shm, a tmpfs or "
                        "a hugetlbfs mount"
                    )
                raise PoolError(f"cudaHostRegister failed with CUDA error {int(rc)}{hint}")
            registered.append(self._base + offset)

        try:
            # One thread: the driver serialises registrations, and more threads
            # only made it slower (docs/benchmarks.md).
            self.pin_seconds = self._run_chunks("pinning the pool", register, self.registration_bytes, 1)
        except PoolError:
            for ptr in registered:
                cudart.cudaHostUnregister(ptr)
            if required:
                raise
            log.warning("pinning the pool failed; continuing unpinned", exc_info=True)
            return
        self._registered = registered
        self._cudart = cudart
        self.pinned = True
        log.info(
            "pool pinned in %.2f s (%.2f s/GiB)",
            self.pin_seconds,
            self.pin_seconds / max(self.size / 2**30, 1e-9),
        )

    @property
    def base_address(self) -> int:
        """Address of slot 0; with CUDA, also valid on the GPUs (mapped, UVA)."""
        return self._base

    # ------------------------------------------------------------ slots

    @property
    def used_slots(self) -> int:
        return self.num_slots - self.slots.free

    def allocate(self, node: int | None = None) -> int | None:
        """A free slot, of NUMA `node`'s range while it has one (free_slots.py)."""
        # A free slot's record is empty (a new file is zeros, release clears
        # it, keep_only clears the rest after adoption): a restart while new
        # bytes arrive finds an empty slot, never an old record over them.
        return self.slots.allocate(node)

    def release(self, slot: int) -> None:
        # A block dropped (evicted, cleared) must not come back at a restart,
        # nor a seal still on its way write its record (tiers/warm.py).
        self.records[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES] = _EMPTY_RECORD
        self.epochs[slot] += 1
        self.slots.release(slot)

    def slot_view(self, slot: int, length: int) -> memoryview:
        start = slot * self.slot_bytes
        return memoryview(self.buffer)[start : start + length]

    def keep_only(self, used: set[int]) -> None:
        """After adoption: `used` hold blocks; every other slot is free and its
        record cleared."""
        for slot in self.slots.keep_only(used):
            self.records[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES] = _EMPTY_RECORD

    def numa_nodes(self) -> list[NodeSlots]:
        """Each node's range, use and GPUs; a pool not carved is one entry."""
        p = self.placement
        if not self.slots.carved:
            node = p.detected[0] if len(p.detected) == 1 else -1
            return [NodeSlots(node, 0, self.num_slots, self.used_slots, False, p.all_gpus())]
        return [
            NodeSlots(r.node, r.first, r.count, r.count - self.slots.free_in(i), self.bound.get(r.node, False),
                      p.gpus.get(r.node, ()))
            for i, r in enumerate(self.slots.ranges)
        ]

    def close(self, discard: bool = False) -> None:
        """Unmaps the pool; the file stays for the next daemon unless `discard`."""
        if not discard and not self.buffer.closed:
            self._write_header(kept_at=time.time())
        for ptr in self._registered:
            self._cudart.cudaHostUnregister(ptr)
        self._registered = []
        try:
            self.records.release()
            self.buffer.close()
        except BufferError:
            # A view of the buffer is still alive (CUDA registration); the
            # mapping goes with the process.
            pass
        if discard:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
