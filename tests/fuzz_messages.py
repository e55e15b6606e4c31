"""Hypothesis strategies for kvdepot's requests, built field by field from the
descriptors of proto/kvdepot.proto: huge, negative-as-unsigned and edge-case
numbers, random bytes and text (newlines and format directives included),
repeated fields of random length. About half of the requests are a valid
request of the fuzzer's own with random fields laid over it, so that they get
past the first checks; ids come from the fuzzer's own sessions, workers,
engines and jobs (`state`, read when a request is drawn) as often as at random.
Used by tests/fuzz_client.py.
"""

from __future__ import annotations

import os

from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from kvdepot.defaults import KEY_BYTES, PROTOCOL_VERSION
from kvdepot.proto import kvdepot_pb2 as pb

MAX_LIST = 40
NUM_BLOCKS = 128

U32_EDGES = [0, 1, 2, 3, 7, 127, 128, 255, 4096, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 2, (1 << 32) - 1]
U64_EDGES = U32_EDGES + [1 << 32, (1 << 53) + 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 2, (1 << 64) - 1]
I64_EDGES = [0, 1, -1, 2, -2, 64, 4096, 1 << 31, -(1 << 31), 1 << 32, (1 << 62), (1 << 63) - 1, -(1 << 63)]
TEXT_EDGES = ["", "\n", "x\nERROR forged log line", "\x00", "é", "../../etc/passwd", "%s%d%n", "a" * 300]
DTYPES = ["bfloat16", "float16", "float32", "uint8", "float8_e4m3fn", "int64", "bool", "complex64"]


def edged(edges, low, high):
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


U32 = edged(U32_EDGES, 0, (1 << 32) - 1)
U64 = edged(U64_EDGES, 0, (1 << 64) - 1)
I64 = edged(I64_EDGES, -(1 << 63), (1 << 63) - 1)
TEXT = st.one_of(st.sampled_from(TEXT_EDGES), st.text(max_size=40))
BYTES = st.one_of(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), st.binary(max_size=80))


def valid_namespace() -> pb.NamespaceSpec:
    return pb.NamespaceSpec(model="fuzz-model", kv_dtype="bfloat16", block_size=16, layout="per_layer", tp_size=1,
                            key_version=1)


def valid_tensor() -> dict:
    # [2, NUM_BLOCKS, 16 tokens, 2 heads, 32 dims] of bfloat16, blocks on dimension 1.
    return dict(name="l0", dtype="bfloat16", shape=[2, NUM_BLOCKS, 16, 2, 32],
                strides=[NUM_BLOCKS * 1024, 1024, 64, 32, 1], byte_offset=0,
                storage_bytes=2 * NUM_BLOCKS * 1024 * 2, block_dim=1, page_bytes=2048)


def valid_worker(session_id: str) -> dict:
    return dict(session_id=session_id, namespace=valid_namespace(), rank=0, device="cpu",
                tensors=[pb.TensorSpec(**valid_tensor())],
                handles=[pb.TensorHandle(shared_memory=pb.SharedMemoryWorker())])


def scalar(field: FD):
    t = field.type
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return U32
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return U64
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return I64
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32, FD.TYPE_ENUM):
        return st.integers(-(1 << 31), (1 << 31) - 1)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return st.floats(width=32 if t == FD.TYPE_FLOAT else 64)
    if t == FD.TYPE_STRING:
        return TEXT
    if t == FD.TYPE_BYTES:
        return BYTES
    raise TypeError(field.full_name)


def field_strategy(field: FD, state, depth: int):
    """Values for a field: by its name where the daemon gives the name a meaning, else by its type."""
    name = field.name
    by_name = {
        "session_id": st.one_of(
            st.builds(lambda: state.session_id), st.builds(lambda: state.other_session_id),
            st.builds(lambda: state.session_id + "\n"), TEXT,
        ),
        "worker_id": st.one_of(st.builds(lambda: state.worker_id), U32),
        "engine_id": st.one_of(st.builds(lambda: state.engine_id), U32),
        "job_id": st.one_of(st.integers(0, 40), U64),
        "request_id": st.one_of(st.integers(0, 40), U64),
        "keys": st.one_of(
            st.lists(st.one_of(st.sampled_from(state.known_keys), BYTES), max_size=MAX_LIST),
            # More keys than the pool has slots, or a whole block table's worth.
            st.integers(0, 1100).map(lambda n: [state.known_keys[0]] * n),
        ),
        "block_ids": st.one_of(
            st.lists(st.one_of(st.integers(0, NUM_BLOCKS - 1), U32), max_size=MAX_LIST),
            st.integers(0, 1100).map(lambda n: list(range(n))),
        ),
        "namespace_name": st.one_of(st.builds(lambda: state.namespace_name), TEXT),
        "dtype": st.one_of(st.sampled_from(DTYPES), TEXT),
        "shape": st.lists(st.one_of(st.integers(-2, 300), I64), max_size=8),
        "strides": st.lists(st.one_of(st.integers(-2, 5000), I64), max_size=8),
        "protocol_version": st.one_of(st.just(PROTOCOL_VERSION), U32),
    }
    if name in by_name:
        return by_name[name]
    if name == "tensors":
        tensor = message_dict(field.message_type, state, depth + 1)
        # The valid tensor with some of its fields replaced gets as far as the layout checks.
        mutant = tensor.map(lambda d: {**valid_tensor(), **d})
        return st.one_of(st.lists(mutant, min_size=1, max_size=3), st.lists(tensor, max_size=3))
    if field.type == FD.TYPE_MESSAGE:
        inner = message_dict(field.message_type, state, depth + 1)
        if name == "namespace":
            inner = st.one_of(st.builds(valid_namespace), inner)
        if field.is_repeated:
            return st.lists(inner, max_size=4 if depth < 2 else 1)
        return inner
    values = scalar(field)
    if field.is_repeated:
        return st.lists(values, max_size=MAX_LIST)
    return values


def message_dict(descriptor, state, depth: int = 0):
    """A dict of some of the message's fields (each present or not), values by field_strategy."""
    if depth > 3:
        return st.just({})
    optional = {f.name: field_strategy(f, state, depth) for f in descriptor.fields}
    return st.fixed_dictionaries({}, optional=optional)


def build(cls, fields):
    """The message of type `cls` that `fields` (a dict, or a message already) describes."""
    if isinstance(fields, Message):
        return fields
    message = cls()
    for name, value in fields.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        if field.type == FD.TYPE_MESSAGE:
            sub_cls = GetMessageClass(field.message_type)
            if field.is_repeated:
                getattr(message, name).extend(build(sub_cls, item) for item in value)
            else:
                getattr(message, name).CopyFrom(build(sub_cls, value))
        elif field.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


def request_strategy(method, state):
    """A request for the method: random fields, or random fields over a valid request."""
    cls = getattr(pb, method.input_type.name)
    random_fields = message_dict(method.input_type, state)
    valid = valid_request(method.name, state)
    if valid is None:
        return random_fields.map(lambda d: build(cls, d))
    return st.one_of(
        random_fields.map(lambda d: build(cls, d)),
        random_fields.map(lambda d: merged(cls, valid(), build(cls, d))),
    )


def merged(cls, base: dict, over):
    message = cls(**base)
    # Scalars and oneofs set in `over` replace the valid ones; repeated fields are appended to.
    message.MergeFrom(over)
    return message


def valid_request(method: str, state):
    """A function that gives a valid request's fields now (ids change as the fuzzer goes)."""
    def job():
        return dict(session_id=state.session_id, worker_id=state.worker_id, job_id=state.rng.randrange(2, 1 << 40),
                    keys=state.known_keys[:4], block_ids=[10, 11, 12, 13])

    return {
        "Attach": lambda: dict(client_name="f", pid=os.getpid(), protocol_version=PROTOCOL_VERSION),
        "RegisterEngine": lambda: dict(session_id=state.session_id, namespace=valid_namespace()),
        "RegisterWorker": lambda: valid_worker(state.session_id),
        "Lookup": lambda: dict(session_id=state.session_id, engine_id=state.engine_id, keys=state.known_keys),
        "ReportLookups": lambda: dict(session_id=state.session_id, engine_id=state.engine_id, lookups=1),
        "SubmitStore": job,
        "SubmitLoad": job,
        "GetStats": lambda: dict(session_id=state.session_id),
        "Clear": lambda: dict(namespace_name=state.namespace_name, session_id=state.session_id),
    }.get(method)


def job_script(state):
    """A connection's worth of job socket traffic: maybe a hello, frames, garbage, a cut-off end."""
    frame = frame_strategy(state)
    hello = st.one_of(
        st.builds(lambda: ("hello", state.session_id)),
        st.builds(lambda: ("hello", state.other_session_id)),
        TEXT.map(lambda s: ("hello", s)),
    )
    action = st.one_of(
        frame.map(lambda f: ("frame", f)),
        st.binary(max_size=200).map(lambda b: ("raw", b)),
        st.tuples(U32, st.binary(max_size=64)).map(lambda t: ("length", t)),
    )
    return st.tuples(st.one_of(hello, hello, hello, action), st.lists(action, max_size=8), st.booleans())


def frame_strategy(state):
    def with_session(frame):
        # Most frames name the fuzzer's own session, as a real connection's would.
        kind = frame.WhichOneof("kind")
        if kind in ("submit_store", "submit_load") and state.rng.random() < 0.7:
            body = getattr(frame, kind)
            body.session_id, body.worker_id = state.session_id, state.worker_id
        return frame

    return message_dict(pb.JobFrame.DESCRIPTOR, state).map(lambda d: with_session(build(pb.JobFrame, d)))
