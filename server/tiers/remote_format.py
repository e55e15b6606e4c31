"""What the remote tier writes to a shared store, and the checks on what it reads back.

Any client of a shared Valkey/Redis can write any key, so a value read back is
untrusted until it passes every check below; one that fails is a miss, never
bytes in a slot a GPU reads. A value is one shard (one block of one TP rank):

    header (HEADER, little-endian)
        magic       4 bytes  b"KVDR"
        version     uint16   FORMAT_VERSION
        key_length  uint16   bytes of the store key that follows the header
        secret_id   uint32   names the secret the HMAC is under (4 bytes of its SHA-256)
        length      uint64   payload bytes
        checksum    uint64   xxh3-64 of the payload
    key             the value's own store key (a value copied under another key fails)
    payload         the shard's bytes
    mac             HMAC-SHA256 over header, key and payload, under the sharing group's secret

The checksum tells corruption (a torn or truncated write, a flipped byte) from
forgery in the counters; the HMAC is what makes a value trustworthy: without
the group's secret no one can write a value the group accepts, and the key
inside it binds it to its namespace (model, layout, tenant scope), block and rank.
Secrets rotate by naming the new one and the old one: values under either are
read, new ones are written under the new.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVDR"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHIQQ")
MAC_BYTES = 32
MAX_KEY_BYTES = 512
# Shorter secrets are refused: the HMAC is only as strong as its key.
MIN_SECRET_BYTES = 16


class Rejected(Exception):
    """A value read back that must not be served; `cause` names the check it failed."""

    def __init__(self, cause: str, detail: str = ""):
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause


def secret_id(secret: bytes) -> int:
    return int.from_bytes(hashlib.sha256(b"kvdepot-remote-secret-id\0" + secret).digest()[:4], "little")


@dataclass(frozen=True)
class Secrets:
    """A sharing group's secrets: values are written under `current`, read under it or `previous`."""

    current: bytes
    previous: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        for secret in (self.current, *self.previous):
            if len(secret) < MIN_SECRET_BYTES:
                raise ValueError(f"a remote tier secret has at least {MIN_SECRET_BYTES} bytes, not {len(secret)}")

    def by_id(self, sid: int) -> bytes | None:
        for secret in (self.current, *self.previous):
            if secret_id(secret) == sid:
                return secret
        return None


def store_key(prefix: str, namespace_digest: bytes, block_key: bytes, rank: int) -> bytes:
    """`prefix:namespace:block:rank`; the prefix is what an operator's ACL grants (`~prefix:*`)."""
    return f"{prefix}:{namespace_digest.hex()}:{block_key.hex()}:{rank}".encode()


def encode(key: bytes, payload, secrets: Secrets) -> list:
    """The value, as the buffers to send one after another (the payload is not copied)."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"a store key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
    view = memoryview(payload).cast("B")
    header = HEADER.pack(MAGIC, FORMAT_VERSION, len(key), secret_id(secrets.current), len(view),
                         xxhash.xxh3_64_intdigest(view))
    mac = hmac.new(secrets.current, header, "sha256")
    mac.update(key)
    mac.update(view)
    return [header, key, view, mac.digest()]


def sealed_size(key: bytes, length: int) -> int:
    """Bytes of the value of a `length`-byte payload under `key`."""
    return HEADER.size + len(key) + length + MAC_BYTES


def seal_into(buffer, key: bytes, payload, secrets: Secrets) -> memoryview:
    """The value written into `buffer` (at least sealed_size bytes: a buffer
    reused value after value costs no fresh pages); returns the view of it."""
    parts = encode(key, payload, secrets)
    out = memoryview(buffer)[: sealed_size(key, len(parts[2]))]
    at = 0
    for part in parts:
        out[at : at + len(part)] = part
        at += len(part)
    return out


def stored_payload(size: int, key: bytes, block_bytes: int, max_length: int) -> int:
    """The payload length a value of `size` bytes under `key` holds (`size`:
    its STRLEN, 0 when absent, -1 when not a string). A value's length is
    anyone's who can write the store, and slots are taken (blocks evicted) by
    it before the value is read: it must be a block of `block_bytes` (0: not
    known yet) and at most `max_length`. 0 when absent; Rejected otherwise."""
    payload = size - sealed_size(key, 0)
    if size == 0:
        return 0
    if size < 0:
        raise Rejected("bad_type", "not a string value")
    if block_bytes and payload != block_bytes:
        raise Rejected("truncated" if payload < block_bytes else "bad_length", f"{payload} bytes")
    if not 0 < payload <= max_length:
        raise Rejected("bad_length" if payload > 0 else "truncated", f"{payload} bytes")
    return payload


def decode(value, key: bytes, secrets: Secrets, max_length: int) -> memoryview:
    """The payload of `value` read under `key`, or Rejected with the cause."""
    if value is None:
        raise Rejected("missing")
    view = memoryview(value).cast("B")
    if len(view) < HEADER.size + MAC_BYTES:
        raise Rejected("truncated", f"{len(view)} bytes")
    magic, version, key_length, sid, length, checksum = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise Rejected("bad_magic")
    if version != FORMAT_VERSION:
        raise Rejected("bad_version", str(version))
    # Sizes checked against the bytes there are before any arithmetic on them.
    if key_length > MAX_KEY_BYTES or length > max_length:
        raise Rejected("bad_length", f"key {key_length}, payload {length}")
    if len(view) != HEADER.size + key_length + length + MAC_BYTES:
        raise Rejected("truncated", f"{len(view)} bytes for a payload of {length}")
    start = HEADER.size + key_length
    if view[HEADER.size : start] != key:
        raise Rejected("wrong_key")
    payload = view[start : start + length]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise Rejected("corrupt")
    secret = secrets.by_id(sid)
    if secret is None:
        raise Rejected("unknown_secret")
    mac = hmac.new(secret, view[: HEADER.size], "sha256")
    mac.update(key)
    mac.update(payload)
    if not hmac.compare_digest(mac.digest(), view[start + length :]):
        raise Rejected("bad_mac")
    return payload
