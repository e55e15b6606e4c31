"""The disk tier's folder: its lock, its fingerprint and whether O_DIRECT works there.

A folder holds one daemon's disk tier of one format: the lock (held for the
tier's life, released by the kernel when the process dies) keeps a second
daemon out, and the fingerprint a daemon of another format. The folder is
opened once and every name in it is reached through that descriptor (dir_fd),
so a path swapped while the daemon runs (a link or a folder renamed by whoever
can write a folder above it) cannot send any tenant's segments elsewhere.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import mmap
import os
import stat

from kvdepot.server.host import pidlock
from kvdepot.server.host.own_files import ForeignFile, owner_name
from kvdepot.server.host.pool_folder import filesystem_type
from kvdepot.server.host.shard_record import FORMAT_VERSION

PAGE = 4096
KIND = "kvdepot disk tier"
FINGERPRINT = {"format": FORMAT_VERSION, "alignment": PAGE, "kind": KIND}
LOCK_NAME = "kvdepot-disk.lock"
FINGERPRINT_NAME = "kvdepot-disk.json"
PROBE_NAME = "kvdepot-disk.probe"
# Which namespaces were cleared (`kvdepot clear`), up to which segment: their
# records in older segments are not indexed again at the next start.
CLEARED_NAME = "kvdepot-disk-cleared.json"


class DiskTierError(RuntimeError):
    """The directory cannot be used; the message says what to change."""


def open_directory(directory: str) -> int:
    """The folder, created if missing, opened for the tier's life: its descriptor."""
    try:
        if not os.path.isdir(directory):
            os.makedirs(directory, 0o700)
            os.chmod(directory, 0o700)  # whatever the umask
        link = os.lstat(directory)
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, os.geteuid()):
            raise DiskTierError(
                f"the disk tier's directory {directory} is a symbolic link of {owner_name(link.st_uid)}, "
                "who could point it elsewhere: give the folder's own path"
            )
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise DiskTierError(f"cannot open the disk tier's directory {directory}: {e.strerror}") from e
    # Records are checked by hashes anyone can compute: a folder another user
    # can write could hold records they forged, which would reach the GPUs.
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise DiskTierError(
            f"the disk tier's directory {directory} belongs to uid {st.st_uid} with mode {st.st_mode & 0o777:o}: "
            "it must be this user's and writable by it alone (chown it, chmod go-w, or choose another)"
        )
    return fd


def take_lock(directory: str, dir_fd: int) -> int:
    """Locks the folder for this process's life; the lock's descriptor."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd, holder = pidlock.take(LOCK_NAME, dir_fd=dir_fd)
    except ForeignFile as e:
        raise DiskTierError(f"in the disk tier's directory {directory}: {e}") from None
    except OSError as e:
        raise DiskTierError(f"cannot write in the disk tier's directory {directory}: {e.strerror}") from e
    if fd < 0:
        raise DiskTierError(
            f"{directory} is in use by another kvdepot disk tier (pid {holder} holds {path}): "
            "give each daemon a directory of its own"
        )
    return fd


def _open(name: str, flags: int, dir_fd: int) -> int:
    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)


def _write_json(name: str, value, dir_fd: int) -> None:
    """Through a temporary file and a rename, so a crash leaves the old or the new."""
    fd = _open(name + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(fd, 0o600)
        json.dump(value, f)
        f.flush()
        os.fsync(fd)
    os.replace(name + ".new", name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def check_fingerprint(directory: str, dir_fd: int, fresh: bool, log: logging.Logger) -> None:
    path = os.path.join(directory, FINGERPRINT_NAME)
    try:
        with os.fdopen(_open(FINGERPRINT_NAME, os.O_RDONLY, dir_fd), encoding="utf-8") as f:
            found = json.load(f)
    except FileNotFoundError:
        found = None
    except (OSError, ValueError) as e:
        found = f"an unreadable fingerprint ({e})"
    if isinstance(found, dict):
        found = {k: found.get(k) for k in FINGERPRINT}
    if found not in (None, FINGERPRINT) and not fresh:
        what = found
        if isinstance(found, dict):
            what = f"a fingerprint of format {found['format']}, kind {found['kind']!r}"
        raise DiskTierError(
            f"{directory} holds {what} ({path}), and this kvdepot's disk tier is format "
            f"{FORMAT_VERSION}: start with a fresh disk tier to discard its segments, or choose another directory"
        )
    if fresh:
        names = [n for n in os.listdir(dir_fd) if fnmatch.fnmatch(n, "seg-*.kvd")]
        for name in names:
            if stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=dir_fd)
        log.info("disk tier at %s started fresh: %d segments deleted", directory, len(names))
        save_cleared(directory, dir_fd, {})
    if fresh or found != FINGERPRINT:
        _write_json(FINGERPRINT_NAME, FINGERPRINT, dir_fd)


def probe_direct(directory: str, dir_fd: int, mode: str, log: logging.Logger) -> bool:
    """Whether O_DIRECT works in the folder (mode auto), or must (on)."""
    if mode == "off":
        return False
    page = mmap.mmap(-1, PAGE)  # page aligned
    try:
        fd = _open(PROBE_NAME, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, dir_fd)
        try:
            os.pwrite(fd, page, 0)
        finally:
            os.close(fd)
        return True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise DiskTierError(f"cannot write in the disk tier's directory {directory}: {e.strerror}") from e
        fs = filesystem_type(directory)
        if mode == "on":
            raise DiskTierError(
                f"direct I/O (O_DIRECT) is not supported in {directory} (a {fs} filesystem): "
                "put the disk tier on a disk's filesystem (ext4, xfs), or set direct to auto or off"
            ) from e
        log.info("the disk tier's %s (%s) does not support O_DIRECT: buffered I/O", directory, fs)
        return False
    finally:
        page.close()
        try:
            os.unlink(PROBE_NAME, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


def load_cleared(directory: str, dir_fd: int) -> dict[str, int]:
    """{namespace digest in hex, or "*" for all: the last segment cleared}."""
    path = os.path.join(directory, CLEARED_NAME)
    try:
        with os.fdopen(_open(CLEARED_NAME, os.O_RDONLY, dir_fd), encoding="utf-8") as f:
            cleared = json.load(f)
        if not isinstance(cleared, dict) or not all(isinstance(v, int) for v in cleared.values()):
            raise ValueError("not a map of segment numbers")
        return cleared
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        # Forgetting a clear would serve what an operator removed: refuse.
        raise DiskTierError(f"cannot read {path} ({e}): fix or remove it, or start with a fresh disk tier") from e


def save_cleared(directory: str, dir_fd: int, cleared: dict[str, int]) -> None:
    _write_json(CLEARED_NAME, cleared, dir_fd)
