"""The namespaces that records name, kept in a file beside the records.

A record names its namespace by a digest (record.ns_digest); the catalog maps
each digest back to the namespace's identity and its ranks' layout signatures,
so that a daemon that adopts records can rebuild the namespace they belong to,
scope (tenant) included. It is rewritten whole, through a temporary file and a
rename, so that a crash leaves the old or the new catalog, never half of one;
and a digest only ever maps to one identity, so an old catalog is never wrong,
at most short of entries (whose records are then discarded).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat

from kvdepot.server.host.own_files import described
from kvdepot.server.host.shard_record import ns_digest

log = logging.getLogger("kvdepot.tiers")

# The fields of a namespace identity (namespaces._identity), in order.
IDENTITY_FIELDS = (
    "scope", "model", "revision", "kv_dtype", "block_size", "layout", "tp_size", "kv_group", "extra", "key_version",
)


def _tuples(value):
    """JSON gives lists where the signatures had tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class Catalog:
    def __init__(self, path: str):
        self.path = path
        # digest -> {"identity": [...], "ranks": {rank: signature}}
        self._entries: dict[bytes, dict] = {}
        self.write_errors = 0
        self._last_error = ""

    def load(self) -> str:
        """Reads the file; '' when loaded (or absent), else why it was ignored."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                os.close(fd)
                # In /dev/shm anyone may have put it there first.
                return f"{self.path} is not this user's alone (uid {st.st_uid}, mode {st.st_mode & 0o777:o})"
            with os.fdopen(fd, encoding="utf-8") as f:
                raw = json.load(f)
            entries = {}
            for digest_hex, entry in raw["namespaces"].items():
                identity = entry["identity"]
                if len(identity) != len(IDENTITY_FIELDS):
                    raise ValueError("an identity of another shape")
                digest = bytes.fromhex(digest_hex)
                if ns_digest(tuple(identity)) != digest:
                    raise ValueError("an entry whose digest does not match its identity")
                ranks = {int(r): _tuples(sig) for r, sig in entry.get("ranks", {}).items()}
                entries[digest] = {"identity": tuple(identity), "ranks": ranks}
        except FileNotFoundError:
            return ""
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{self.path} cannot be read ({e})"
        self._entries = entries
        return ""

    def identity(self, digest: bytes) -> tuple | None:
        entry = self._entries.get(digest)
        return entry["identity"] if entry else None

    def signatures(self, digest: bytes) -> dict[int, tuple]:
        entry = self._entries.get(digest)
        return dict(entry["ranks"]) if entry else {}

    def note(self, identity: tuple, ranks: dict[int, tuple]) -> bytes:
        """The digest of `identity`, written to the file first if the catalog
        did not know it (or a rank's signature) yet."""
        digest = ns_digest(identity)
        entry = self._entries.get(digest)
        if entry is not None and all(entry["ranks"].get(r) == s for r, s in ranks.items()):
            return digest
        known = dict(entry["ranks"]) if entry else {}
        known.update(ranks)
        self._entries[digest] = {"identity": tuple(identity), "ranks": known}
        self._write()
        return digest

    def claim(self) -> None:
        """Writes the (empty) catalog of a new pool at once: its name, known to
        anyone who lists the pool's folder, is then this user's file, which
        nobody else can remove or replace in a shared /dev/shm."""
        self._write()

    def _write(self) -> None:
        body = {
            "namespaces": {
                d.hex(): {"identity": list(e["identity"]), "ranks": {str(r): s for r, s in e["ranks"].items()}}
                for d, e in self._entries.items()
            }
        }
        # A name nobody can guess, so nobody can have put something there first.
        temporary = f"{self.path}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(body, f)
            os.replace(temporary, self.path)
        except OSError as e:
            # The records it would name are discarded at the next start: a
            # smaller warm cache, not a wrong one; but an operator must hear of it.
            self.write_errors += 1
            why = e.strerror or str(e)
            try:
                st = os.lstat(self.path)
                if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
                    why = f"{self.path} is {described(st)}, not this user's file"
            except OSError:
                pass
            if why != self._last_error:
                self._last_error = why
                log.error(
                    "cannot write the namespace catalog %s (%s): the blocks the pool keeps will not be adopted "
                    "by the next daemon; remove what is in the way, or give --pool-dir a folder of this user's",
                    self.path, why,
                )
            try:
                os.unlink(temporary)
            except OSError:
                pass
        else:
            self._last_error = ""
