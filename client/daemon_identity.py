"""Whether what answers on a unix socket is the daemon this client means.

Anyone can create a socket folder before its owner does (/tmp/kvdepot-UID is
a predictable name) and serve a kvdepotd of their own there, which would read
every prompt's KV an engine stores and could serve it KV of theirs. So before
anything is sent, the kernel says who the peer is (SO_PEERCRED), and the
socket's folder must be one that only a trusted uid can change, so the socket
cannot be swapped between that check and gRPC's own connection to it.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import struct

from kvdepot.errors import InvalidArgument, UntrustedDaemon

_UCRED = struct.Struct("3i")  # struct ucred: pid_t pid; uid_t uid; gid_t gid


DAEMON_UIDS_ENV = "KVDEPOT_DAEMON_UIDS"


def daemon_uids_setting(daemon_uids=None) -> list[int]:
    """The uids given, else $KVDEPOT_DAEMON_UIDS (comma-separated); InvalidArgument naming a bad one."""
    if daemon_uids is not None:
        values, where = list(daemon_uids), "daemon_uids"
    else:
        values, where = [v for v in os.environ.get(DAEMON_UIDS_ENV, "").split(",") if v.strip()], DAEMON_UIDS_ENV
    uids = []
    for value in values:
        try:
            uid = int(str(value).strip()) if not isinstance(value, bool) else -1
        except ValueError:
            uid = -1
        if uid < 0:
            raise InvalidArgument(f"{where}: {value!r} is not a uid (a number >= 0)")
        uids.append(uid)
    return uids


def trusted_uids(daemon_uids=()) -> frozenset[int]:
    """root, this process's user, and the uids the configuration names."""
    return frozenset({0, os.geteuid(), *(int(uid) for uid in daemon_uids)})


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _how_to_allow(uid: int) -> str:
    return (
        f"if {_who(uid)} runs your kvdepotd, allow it with KVDepotClient(daemon_uids=[{uid}]) "
        f"(the connector's daemon_uids setting; `kvdepot --daemon-uids {uid}` or KVDEPOT_DAEMON_UIDS={uid}); "
        "otherwise use a socket in a folder of your own (set XDG_RUNTIME_DIR, or KVDEPOT_SOCKET)"
    )


def socket_path(target: str) -> str | None:
    """The socket file of a gRPC target, None for TCP (the token and TLS name the daemon there)."""
    if not target.startswith("unix:"):
        return None
    path = target[len("unix:"):]
    return "/" + path.lstrip("/") if path.startswith("//") else path


def check_peer(sock: socket.socket, path: str, trusted: frozenset[int]) -> None:
    """UntrustedDaemon unless the kernel says a trusted uid listens on `sock`
    (`trusted`: see trusted_uids)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, _ = _UCRED.unpack(raw)
    if uid not in trusted:
        raise UntrustedDaemon(
            f"the daemon on {path} runs as {_who(uid)} (pid {pid}), which this client does not trust: "
            f"nothing was sent to it. {_how_to_allow(uid)}"
        )


def check_daemon(target: str, trusted: frozenset[int], timeout: float) -> str:
    """The target to connect to: on a unix socket, its path with every link
    resolved, checked; UntrustedDaemon when it is not a trusted daemon's. A
    socket nothing listens on passes: gRPC says so itself."""
    path = socket_path(target)
    if path is None:
        return target
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    try:
        st = os.stat(folder)
    except OSError:
        return target
    if st.st_uid not in trusted or st.st_mode & 0o022 or not stat.S_ISDIR(st.st_mode):
        raise UntrustedDaemon(
            f"the daemon's socket folder {folder} belongs to {_who(st.st_uid)} with mode "
            f"{st.st_mode & 0o7777:o}: a folder that an untrusted user can change could hold their daemon, "
            f"so this client does not connect there. {_how_to_allow(st.st_uid)}"
        )
    _check_ancestors(folder, trusted)
    path = os.path.join(folder, os.path.basename(path))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:
            return "unix:" + path
        check_peer(sock, path, trusted)
    return "unix:" + path


def _check_ancestors(folder: str, trusted: frozenset[int]) -> None:
    """Nobody untrusted can rename a folder above the socket's and put one of
    theirs in its place: each is a trusted uid's, and writable by others only
    with the sticky bit (as /tmp), which keeps others from renaming what is not theirs."""
    above = os.path.dirname(folder)
    while True:
        try:
            st = os.stat(above)
        except OSError:
            return
        open_to_others = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
        if st.st_uid not in trusted or open_to_others:
            raise UntrustedDaemon(
                f"{above}, a folder above the daemon's socket, belongs to {_who(st.st_uid)} with mode "
                f"{st.st_mode & 0o7777:o}: an untrusted user could swap the socket's folder for one of theirs, "
                f"so this client does not connect there. {_how_to_allow(st.st_uid)}"
            )
        if above == "/":
            return
        above = os.path.dirname(above)
