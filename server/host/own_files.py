"""Files and folders that must be the daemon user's alone.

The daemon keeps files in folders others may write (/dev/shm, /tmp): there a
name can be taken first, by a symbolic link to a file of the daemon's or by a
file of another user's. So such a file is opened without following links and
checked, on the descriptor, for its owner and mode before anything is written
to it or read from it; and a folder the daemon serves from must be its own.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat


class ForeignFile(OSError):
    """A file or folder the daemon would use is not its user's alone; the
    message names the path, its owner and what to do (never text from the file)."""


def owner_name(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def described(st: os.stat_result) -> str:
    """What a name is and whose: "a directory of uid 65534 (nobody)"."""
    kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
    return f"{kind} of {owner_name(st.st_uid)}"


def _foreign(path: str, st: os.stat_result, what: str) -> ForeignFile:
    return ForeignFile(
        f"{path} is {described(st)} with mode {st.st_mode & 0o7777:o}, {what}: "
        f"another user may have put it there. Remove it (and find out who made it), or give the daemon a "
        f"folder only its user (uid {os.geteuid()}) can write"
    )


def open_own(path: str, flags: int, mode: int = 0o600, dir_fd: int | None = None) -> int:
    """os.open of a plain file of this user's that only it can write, never
    through a link; ForeignFile (an OSError) for anything else at `path`
    (relative to `dir_fd` where given)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    except OSError as e:
        # ELOOP: a link; EACCES (fs.protected_regular) or EISDIR: something of another's.
        if e.errno in (errno.ELOOP, errno.EACCES, errno.EISDIR, errno.ENXIO, errno.EPERM):
            try:
                st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                raise e from None
            if st.st_uid == os.geteuid() and stat.S_ISREG(st.st_mode):
                raise
            raise _foreign(path, st, "not a plain file of this daemon's user") from None
        raise
    try:
        check_own_file(path, os.fstat(fd))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_own_file(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _foreign(path, st, "not a plain file")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise _foreign(path, st, "not this daemon user's alone")
    if st.st_nlink != 1:
        # A hard link to a file of the daemon's that someone made elsewhere.
        raise _foreign(path, st, f"a file with {st.st_nlink} names, where the daemon's have one")


def check_own_folder(path: str, what: str) -> None:
    """A folder the daemon serves from (its socket's): only its user may
    create or replace names there, or a client could be sent elsewhere."""
    try:
        link = os.lstat(path)
        st = os.stat(path)
    except OSError as e:
        raise ForeignFile(f"cannot check {what} {path}: {e.strerror}") from None
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, os.geteuid()):
        raise _foreign(path, link, f"{what}, which its owner could point elsewhere")
    if not stat.S_ISDIR(st.st_mode):
        raise ForeignFile(f"{what} {path} is not a folder")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        elsewhere = "--listen a path in a folder of your own (e.g. under $XDG_RUNTIME_DIR)"
        # A folder every user may write to (/tmp, /dev/shm) is shared on purpose: never one to take over.
        if st.st_mode & stat.S_ISVTX and st.st_mode & 0o002:
            remedy = f"Give {elsewhere}"
        else:
            remedy = (f"If it is yours, `chown {os.geteuid()} {path}; chmod go-w {path}`; otherwise remove it or "
                      f"give {elsewhere}")
        raise ForeignFile(
            f"{what} {path} belongs to {owner_name(st.st_uid)} with mode {st.st_mode & 0o7777:o}: it must be "
            f"this daemon user's (uid {os.geteuid()}) and writable by it alone, or another user could serve "
            f"clients in its place. {remedy}"
        )
