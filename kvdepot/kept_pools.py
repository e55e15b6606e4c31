"""Pool files that daemons keep in shared memory: their header, and which of
them no daemon serves.

A pool file outlives its daemon so that the next daemon on the same address
adopts its blocks. Its header (the file's last page) names the address it
belongs to, the lock a daemon serving that address holds, and when it was kept
(0 while a daemon serves it). The daemon (server/host/pool.py) writes it;
the daemon at start and `kvdepot pools` read it here, to tell a pool that
a live daemon serves (its address lock is held) from one that only takes RAM.
"""

from __future__ import annotations

import os
import stat
import struct
import time
from dataclasses import dataclass

import xxhash

from kvdepot.pool_parts import (
    MAX_PARTS,
    TOKEN_BYTES,
    Layout,
    first_file_name,
    is_part_name,
    own_plain_file,
    parts_bytes,
    remove_parts,
    why_not_alone,
)

HEADER_BYTES = 4096
HEADER_MAGIC = b"KVDPOOL2"
# magic, format, key version, slot bytes, slots, file size, kept at (unix
# seconds; 0 while served); then the address and its lock's path, then their hash.
HEADER = struct.Struct("<8sIIQQQd256s512s")
# A pool of several files (pool_parts.py) adds how many, its stripe's bytes
# and the tokens that end its later files' names; one of one file keeps the
# header above, which earlier daemons read.
PARTS_MAGIC = b"KVDPOOL3"
PARTS_HEADER = struct.Struct(f"<8sIIQQQd256s512sQQ{(MAX_PARTS - 1) * TOKEN_BYTES}s")
HEADER_HASH = struct.Struct("<Q")
POOL_PREFIX = "kvdepot-"
POOL_SUFFIX = ".pool"
CATALOG_SUFFIX = ".namespaces.json"


def pack_header(fmt: int, key_version: int, slot_bytes: int, num_slots: int, file_size: int,
                address: str, lock_path: str, kept_at: float, layout: Layout | None = None) -> bytes:
    """The header of a pool of `file_size` bytes, in one file unless `layout` says otherwise."""
    common = (fmt, key_version, slot_bytes, num_slots, file_size, kept_at, address.encode()[:256],
              lock_path.encode()[:512])
    if layout is None or layout.parts == 1:
        fields = HEADER.pack(HEADER_MAGIC, *common)
    else:
        tokens = b"".join(bytes.fromhex(t) for t in layout.tokens)
        fields = PARTS_HEADER.pack(PARTS_MAGIC, *common, layout.parts, layout.stripe, tokens)
    return fields + HEADER_HASH.pack(xxhash.xxh3_64_intdigest(fields))


def read_header(path: str) -> tuple[dict | None, str]:
    """A pool file's header, or None and why it cannot be adopted. The file
    must be this user's alone: one that another user could write is never
    adopted, since its bytes would reach the GPUs."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        return None, f"cannot open it ({e.strerror})"
    try:
        st = os.fstat(fd)
        if why := why_not_alone(st):
            return None, f"it {why}"
        if st.st_size < HEADER_BYTES:
            return None, "it is too short to hold a header"
        raw = os.pread(fd, PARTS_HEADER.size + HEADER_HASH.size, st.st_size - HEADER_BYTES)
    finally:
        os.close(fd)
    shape = {HEADER_MAGIC: HEADER, PARTS_MAGIC: PARTS_HEADER}.get(raw[:8])
    if shape is None:
        return None, "it has no header of this kvdepot's pool format (a pool of an older kvdepot, or not a pool)"
    if len(raw) < shape.size + HEADER_HASH.size:
        return None, "it is too short to hold a header"
    fields = raw[: shape.size]
    if HEADER_HASH.unpack_from(raw, shape.size)[0] != xxhash.xxh3_64_intdigest(fields):
        return None, "its header is torn"
    _, version, key_version, slot_bytes, num_slots, file_size, kept_at, address, lock, *parts = shape.unpack(fields)
    layout = Layout(file_size)
    if parts:
        count, stripe, tokens = parts
        names = [tokens[i : i + TOKEN_BYTES].hex() for i in range(0, min(count - 1, MAX_PARTS) * TOKEN_BYTES,
                                                                    TOKEN_BYTES)]
        layout = Layout(file_size, count, stripe, tuple(names))
    if why := layout.why_not():
        return None, f"its header names {why}"
    header = {"format": version, "key_version": key_version, "slot_bytes": slot_bytes, "num_slots": num_slots,
              "file_size": file_size, "layout": layout, "mtime": st.st_mtime, "kept_at": kept_at,
              "address": address.rstrip(b"\0").decode(errors="replace"),
              "lock": lock.rstrip(b"\0").decode(errors="replace")}
    if (size := layout.part_sizes()[0]) != st.st_size:
        return None, f"its header makes this file {size} bytes but it has {st.st_size}"
    return header, ""


def lock_holders() -> set[tuple[int, int]]:
    """(device, inode) of every file an flock is held on, from /proc/locks:
    read without taking the lock, so that looking never stops a daemon's start."""
    held = set()
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                # "1: FLOCK ADVISORY WRITE pid MAJ:MIN:INODE ..."; a waiter's line has "->" before FLOCK.
                fields = line.split()
                if len(fields) < 6 or fields[1] != "FLOCK":
                    continue
                try:
                    major, minor, inode = fields[5].split(":")
                    held.add((os.makedev(int(major, 16), int(minor, 16)), int(inode)))
                except ValueError:
                    continue
    except OSError:
        pass
    return held


def served(lock_path: str, held: set[tuple[int, int]] | None = None) -> bool:
    """Whether a live daemon holds the address lock at `lock_path`. Where
    /proc/locks may not tell (a filesystem whose inode it names otherwise), a
    live process of the pid the lock names counts too: a pid used again keeps
    a stale pool a while, which is the safe way to be wrong."""
    if not lock_path:
        return False
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in (lock_holders() if held is None else held):
            return True
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return False
    finally:
        os.close(fd)
    if not text.isdigit() or int(text) <= 0:
        return False
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


@dataclass(frozen=True)
class KeptPool:
    path: str
    bytes: int  # of RAM it holds
    address: str  # '' when its header cannot be read
    # When its daemon stopped; a daemon that died never wrote it: the file's last change then.
    since: float
    live: bool
    # Why its header cannot be read ('' when it can): such a file is never discarded but by hand.
    unreadable: str = ""

    def age(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.since)


def catalog_of(pool_path: str) -> str:
    return pool_path[: -len(POOL_SUFFIX)] + CATALOG_SUFFIX


def kept_pools(directories, uid: int | None = None) -> list[KeptPool]:
    """This user's pool files in `directories`, oldest kept first."""
    uid = os.geteuid() if uid is None else uid
    held = lock_holders()
    found, seen = [], set()
    for directory in directories:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            if not (name.startswith(POOL_PREFIX) and name.endswith(POOL_SUFFIX)):
                continue
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            header, why = read_header(path)
            held_bytes = st.st_blocks * 512 + parts_bytes(path)
            if header is None:
                found.append(KeptPool(path, held_bytes, "", st.st_mtime, False, why))
                continue
            live = served(header["lock"], held)
            since = header["kept_at"] or st.st_mtime
            found.append(KeptPool(path, held_bytes, header["address"], since, live))
    found.sort(key=lambda p: p.since)
    return found


def stale(
    pools: list[KeptPool], max_age: float, max_bytes: int, now: float | None = None,
) -> list[tuple[KeptPool, str]]:
    """The pools to discard, and why: those no live daemon serves that were
    kept longer than `max_age` seconds, then the oldest while the rest hold
    more than `max_bytes`. A pool whose header cannot be read (one being
    created, or of another format) is left alone."""
    now = time.time() if now is None else now
    candidates = [p for p in pools if not p.live and not p.unreadable]
    victims = []
    for pool in candidates:
        if pool.age(now) > max_age:
            victims.append((pool, f"kept {pool.age(now) / 60:.0f} min, longer than --kept-pool-max-age"))
    held = sum(p.bytes for p in candidates) - sum(p.bytes for p, _ in victims)
    for pool in candidates:  # oldest first
        if held <= max_bytes:
            break
        if any(pool is v for v, _ in victims):
            continue
        victims.append((pool, f"kept pools hold {held / 2**30:.2f} GiB, more than --kept-pools-max-bytes"))
        held -= pool.bytes
    return victims


def discard(pool_path: str) -> None:
    """Removes a pool's files and its namespace catalog; OSError if the pool cannot go.
    The later files go first: cut short, what is left is a pool whose header
    names files it lacks, which is never adopted and is removed as a pool."""
    remove_parts(pool_path)
    os.unlink(pool_path)
    try:
        os.unlink(catalog_of(pool_path))
    except FileNotFoundError:
        pass


def orphaned_parts(directories) -> list[str]:
    """This user's later pool files (`x.pool.N.TOKEN`) and namespace catalogs
    (`x.namespaces.json`) whose first file (`x.pool`) is gone: no header names
    them, so nothing adopts them, and they hold RAM (or clutter the folder). A
    pool's first file is made before the others, and its later files are
    removed before it."""
    found = []
    for directory in directories:
        try:
            names = set(os.listdir(directory))
        except OSError:
            continue
        for name in sorted(names):
            if not name.startswith(POOL_PREFIX):
                continue
            if is_part_name(name):
                first = first_file_name(name)
            elif name.endswith(CATALOG_SUFFIX):
                first = name[: -len(CATALOG_SUFFIX)] + POOL_SUFFIX
            else:
                continue
            path = os.path.join(directory, name)
            if own_plain_file(path) and not own_plain_file(os.path.join(directory, first)):
                # Another user's file at the first file's name (its name is
                # seen in the folder) keeps nothing of ours in RAM.
                found.append(path)
    return found

