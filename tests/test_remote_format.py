"""The remote tier's value format: what another node may read only if every check passes."""

from __future__ import annotations

import os

import pytest

from kvdepot.server.tiers import remote_format as fmt
from kvdepot.server.tiers.remote_format import HEADER, Rejected, Secrets, decode, encode, store_key

OURS = Secrets(b"s" * 32)
KEY = store_key("kvd", b"\x01" * 32, b"\x02" * 32, 0)


def value(payload: bytes, key: bytes = KEY, secrets: Secrets = OURS) -> bytearray:
    return bytearray(b"".join(bytes(part) for part in encode(key, payload, secrets)))


def cause(data, key: bytes = KEY, secrets: Secrets = OURS, max_length: int = 1 << 22) -> str:
    with pytest.raises(Rejected) as e:
        decode(data, key, secrets, max_length)
    return e.value.cause


def test_a_value_reads_back_to_its_bytes():
    payload = os.urandom(1 << 20)
    assert bytes(decode(value(payload), KEY, OURS, 1 << 22)) == payload
    assert bytes(decode(value(b""), KEY, OURS, 1 << 22)) == b""


def test_every_damaged_or_foreign_value_is_refused_with_its_cause():
    payload = os.urandom(4096)
    good = value(payload)
    flipped = bytearray(good)
    flipped[HEADER.size + len(KEY) + 100] ^= 1
    assert cause(flipped) == "corrupt"
    assert cause(good[:-1]) == "truncated"
    assert cause(good[:10]) == "truncated"
    assert cause(None) == "missing"
    assert cause(b"XXXX" + good[4:]) == "bad_magic"
    # Copied under another key (another block, rank, namespace or tenant).
    assert cause(good, key=store_key("kvd", b"\x01" * 32, b"\x03" * 32, 0)) == "wrong_key"
    # Written by a client without the group's secret, or with another group's.
    assert cause(value(payload, secrets=Secrets(b"t" * 32))) == "unknown_secret"
    forged = bytearray(good)
    forged[HEADER.size + len(KEY) + 100] ^= 1
    # ... even with the checksum made to match, the MAC does not.
    import xxhash

    header = bytearray(forged[: HEADER.size])
    fields = list(HEADER.unpack(bytes(header)))
    fields[5] = xxhash.xxh3_64_intdigest(bytes(forged[HEADER.size + len(KEY) : -32]))
    forged[: HEADER.size] = HEADER.pack(*fields)
    assert cause(forged) == "bad_mac"
    # A length past what a slot holds is refused before anything is sized from it.
    assert cause(good, max_length=1000) == "bad_length"


def test_a_rotated_secret_reads_old_and_new_values_and_writes_new_ones():
    old, new = b"o" * 32, b"n" * 32
    before = value(b"block", secrets=Secrets(old))
    rotated = Secrets(new, (old,))
    assert bytes(decode(before, KEY, rotated, 100)) == b"block"
    after = value(b"block", secrets=rotated)
    assert bytes(decode(after, KEY, Secrets(new), 100)) == b"block"
    assert cause(after, secrets=Secrets(old)) == "unknown_secret"


def test_short_secrets_are_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Secrets(b"short")


def test_a_stored_length_must_be_a_block_of_the_namespace_before_any_slot_is_taken():
    key = b"kvdepot:fleet:ns:block:0"
    block = 16384
    assert fmt.stored_payload(0, key, block, 1 << 20) == 0  # absent
    assert fmt.stored_payload(fmt.sealed_size(key, block), key, block, 1 << 20) == block
    for size, cause in ((-1, "bad_type"), (fmt.sealed_size(key, block) + 1, "bad_length"),
                        (fmt.sealed_size(key, block) - 1, "truncated"), (5, "truncated"),
                        (fmt.sealed_size(key, 2 << 20), "bad_length")):
        with pytest.raises(fmt.Rejected) as refused:
            fmt.stored_payload(size, key, block, 1 << 20)
        assert refused.value.cause == cause, size
    # No worker has said the block size yet: bounded by a run of slots alone.
    assert fmt.stored_payload(fmt.sealed_size(key, 5000), key, 0, 1 << 20) == 5000
    with pytest.raises(fmt.Rejected):
        fmt.stored_payload(fmt.sealed_size(key, 2 << 20), key, 0, 1 << 20)
