"""The native lane reads the job socket's frames as the protobuf runtime does
(server/native/src/wire.cpp decodes them by hand): the same fields out of
every frame the runtime parses, and a refusal of every frame it refuses,
mangled ones included. A frame the two read differently would be a request
the daemon answers as something it is not."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdepot.proto import kvdepot_pb2 as pb

binding = pytest.importorskip("kvdepot.server.native.binding")

try:
    LIB = binding.load()
except OSError as e:  # the Python lane alone: nothing to compare
    pytest.skip(f"the native lane is not built ({e})", allow_module_level=True)

KINDS = {"hello": 1, "submit_store": 2, "submit_load": 3, "staging": 4}


def native(data: bytes) -> str | None:
    line = LIB.kvd_decode_frame(data, len(data)).decode()
    return None if line == "-" else line


def expected(data: bytes) -> str | None:
    """What the native decoder must say of `data`: the runtime's reading."""
    frame = pb.JobFrame()
    try:
        frame.ParseFromString(data)
    except DecodeError:
        return None
    kind = frame.WhichOneof("kind")
    request = getattr(frame, kind) if kind in ("submit_store", "submit_load") else None

    def hexed(b: bytes) -> str:
        return b.hex() or "_"

    if request is None:
        return f"{KINDS.get(kind, 0)} {frame.request_id} 0 0 0 _ _ _ _"
    store = kind == "submit_store"
    return " ".join([
        str(KINDS[kind]), str(frame.request_id), str(request.worker_id), str(request.job_id),
        str(request.cuda_fence_seq if store else 0), hexed(request.cuda_event_handle if store else b""),
        hexed(request.session_id.encode()), ",".join(k.hex() or "_" for k in request.keys) or "_",
        ",".join(str(b) for b in request.block_ids) or "_",
    ])


U32 = st.one_of(st.sampled_from([0, 1, 127, 128, (1 << 31), (1 << 32) - 1]), st.integers(0, (1 << 32) - 1))
U64 = st.one_of(st.sampled_from([0, 1, (1 << 63), (1 << 64) - 1]), st.integers(0, (1 << 64) - 1))
TEXT = st.one_of(st.sampled_from(["", "é", "\x00", "a" * 40]), st.text(max_size=40))
KEYS = st.lists(st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40)), max_size=6)


@st.composite
def frames(draw) -> bytes:
    kind = draw(st.sampled_from(["submit_store", "submit_load", "hello", "staging", None]))
    frame = pb.JobFrame(request_id=draw(U64))
    if kind == "submit_store":
        frame.submit_store.CopyFrom(pb.SubmitStoreRequest(
            session_id=draw(TEXT), worker_id=draw(U32), job_id=draw(U64), keys=draw(KEYS),
            block_ids=draw(st.lists(U32, max_size=6)), cuda_event_handle=draw(st.binary(max_size=70)),
            cuda_fence_seq=draw(U64)))
    elif kind == "submit_load":
        frame.submit_load.CopyFrom(pb.SubmitLoadRequest(
            session_id=draw(TEXT), worker_id=draw(U32), job_id=draw(U64), keys=draw(KEYS),
            block_ids=draw(st.lists(U32, max_size=6))))
    elif kind == "hello":
        frame.hello.session_id = draw(TEXT)
    elif kind == "staging":
        frame.staging.session_id = draw(TEXT)
    return frame.SerializeToString()


@st.composite
def mangled(draw) -> bytes:
    data = bytearray(draw(frames()))
    for _ in range(draw(st.integers(1, 4))):
        what = draw(st.sampled_from(["cut", "flip", "insert", "append"]))
        at = draw(st.integers(0, len(data)))
        if what == "cut":
            del data[at:]
        elif what == "flip" and data:
            data[min(at, len(data) - 1)] ^= draw(st.integers(1, 255))
        elif what == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            data += draw(st.binary(min_size=1, max_size=12))
    return bytes(data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(frames())
def test_every_frame_the_runtime_writes_reads_the_same(data):
    assert native(data) == expected(data)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(mangled())
def test_mangled_frames_are_read_or_refused_as_the_runtime_does(data):
    assert native(data) == expected(data)


@pytest.mark.parametrize("data", [
    b"",  # an empty JobFrame
    bytes([0x08]),  # a varint cut short
    bytes([0x08]) + b"\xff" * 10 + b"\x01",  # a varint of eleven bytes
    bytes([0x00, 0x00]),  # field number 0
    bytes([0x0b, 0x0c]),  # an empty group (field 1, start and end)
    bytes([0x0b, 0x14]),  # a group ended by another field's end
    bytes([0x0c]),  # an end group with no start
    bytes([0x1f]),  # wire type 7
    bytes([0x1a, 0x05, 0x0a, 0x02, 0xc3, 0x28, 0x00]),  # a session id that is not UTF-8
    bytes([0x1a, 0x04, 0x2a, 0x02, 0x80, 0x80]),  # packed block ids cut inside a varint
    bytes([0x1a, 0x02, 0x10, 0x05, 0x1a, 0x02, 0x18, 0x07]),  # submit_store twice: merged
    bytes([0x1a, 0x02, 0x10, 0x05, 0x22, 0x02, 0x18, 0x07]),  # store then load: the load wins
    bytes([0x1a, 0x03, 0x28, 0x01, 0x2a, 0x1a, 0x02, 0x28, 0x02]),  # a message field's length past its end
    bytes([0x1a, 0x04, 0x28, 0x01, 0x28, 0x02]),  # block ids unpacked
    bytes([0x0d, 0x01, 0x02, 0x03, 0x04, 0x11] + [0] * 8),  # field 1 as fixed32, then fixed64: unknown
    bytes([0xf8, 0xff, 0xff, 0xff, 0x0f, 0x01]),  # the largest field number
    bytes([0x80, 0x80, 0x80, 0x80, 0x80, 0x01, 0x00]),  # a tag past 32 bits
])
def test_frames_at_the_edges_of_the_wire_format(data):
    assert native(data) == expected(data)
