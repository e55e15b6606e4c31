"""A hostile client of its own process: throws hypothesis-generated requests at
every RPC of proto/kvdepot.proto and frames at the job socket of a running
kvdepotd, and reports each answer the daemon should never give. Run by
tests/test_fuzz.py; run it by hand for longer:

  python tests/fuzz_client.py SOCKET --daemon-pid PID --seed 7 --examples 20000

Requests are built field by field from the proto's descriptors (huge,
negative-as-unsigned and edge-case numbers, random bytes and text, repeated
fields of random length), half of them as a valid request of the fuzzer's own
with random fields laid over it, so that they get past the first checks. Ids
come from the fuzzer's own sessions, workers, engines and jobs as often as at
random.

A problem is an answer outside the protocol's typed errors (INTERNAL, UNKNOWN,
a deadline), a job socket that drops or misanswers a well-formed frame, or the
daemon gone. Prints one JSON object: counts by answer, and the problems.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import threading
from collections import Counter
from pathlib import Path

import grpc
from google.protobuf import text_format
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzz_messages import NUM_BLOCKS, job_script, request_strategy, valid_namespace, valid_worker  # noqa: E402

from kvdepot.defaults import (  # noqa: E402
    JOB_FRAME_HEADER,
    KEY_BYTES,
    MAX_HELLO_FRAME_BYTES,
    MAX_JOB_FRAME_BYTES,
    PROTOCOL_VERSION,
)
from kvdepot.proto import kvdepot_pb2 as pb  # noqa: E402
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc  # noqa: E402

# The typed errors of the protocol (proto: "Errors"). Anything else is a bug.
EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}
EXPECTED_NUMBERS = {code.value[0] for code in EXPECTED}
CALL_TIMEOUT = 10.0
SERVICE = pb.DESCRIPTOR.services_by_name["KVDepot"]


class State:
    """What the fuzzer owns in the daemon, read when a request is drawn."""

    def __init__(self, stub, rng: random.Random):
        self.stub = stub
        self.rng = rng
        self.session_id = ""
        self.other_session_id = ""
        self.worker_id = 0
        self.engine_id = 0
        self.namespace_name = ""
        self.known_keys = [rng.randbytes(KEY_BYTES) for _ in range(16)]
        # Jobs the daemon took and that the fuzzer has not completed.
        self.streams = []

    def attach(self, name: str) -> str:
        request = pb.AttachRequest(client_name=name, pid=os.getpid(), protocol_version=PROTOCOL_VERSION)
        stream = self.stub.Attach(request)
        started = next(stream).started
        self.job_socket = started.job_socket
        # Notifications are read as they come, as a client must.
        threading.Thread(target=drain_stream, args=(stream,), daemon=True).start()
        self.streams.append(stream)
        # The hello that gives the session this process's identity; the session
        # keeps it when the connection closes, and this process may say hello again.
        probe = JobSocketProbe(self.job_socket)
        probe.send(encode(pb.JobFrame(hello=pb.JobSocketHello(session_id=started.session_id))))
        reply = probe.answer()
        probe.sock.close()
        if reply is None or not reply.HasField("ready"):
            raise RuntimeError(f"the daemon did not take the fuzzer's hello: {reply}")
        return started.session_id

    def set_up(self) -> None:
        self.session_id = self.attach("fuzzer")
        self.other_session_id = self.attach("fuzzer-other")
        ns = valid_namespace()
        from kvdepot.client.job_socket import hand_over
        from kvdepot.client.shm_copy import StagingMemory

        request = pb.RegisterWorkerRequest(**valid_worker(self.session_id))
        # Kept: the worker's rows, which the daemon copies through.
        self.staging = StagingMemory(NUM_BLOCKS, 2 * 2048)
        request.staging_id = hand_over(self.job_socket, self.session_id, self.staging.fd, CALL_TIMEOUT)
        worker = self.stub.RegisterWorker(request, timeout=CALL_TIMEOUT)
        self.worker_id, self.namespace_name = worker.worker_id, worker.namespace_name
        self.engine_id = self.stub.RegisterEngine(
            pb.RegisterEngineRequest(session_id=self.session_id, namespace=ns), timeout=CALL_TIMEOUT
        ).engine_id
        # Some keys stored, so that loads of known keys get as far as a copy.
        keys = self.known_keys[:8]
        self.stub.SubmitStore(pb.SubmitStoreRequest(session_id=self.session_id, worker_id=self.worker_id, job_id=1,
                                                    keys=keys, block_ids=list(range(8))), timeout=CALL_TIMEOUT)

    def close(self) -> None:
        for stream in self.streams:
            stream.cancel()


def drain_stream(stream) -> None:
    try:
        for _ in stream:
            pass
    except grpc.RpcError:
        pass  # cancelled at the end


class JobSocketProbe:
    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(CALL_TIMEOUT)
        self.sock.connect(path)
        self.closed = False

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            self.closed = True

    def reply(self) -> pb.JobReply | None:
        """The next reply, or None once the daemon has closed the connection."""
        header = self._exactly(JOB_FRAME_HEADER.size)
        if header is None:
            return None
        data = self._exactly(JOB_FRAME_HEADER.unpack(header)[0])
        if data is None:
            raise Problem("job socket", "the daemon cut a reply short", "")
        reply = pb.JobReply()
        reply.ParseFromString(data)
        return reply

    def _exactly(self, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            try:
                chunk = self.sock.recv(n - len(data))
            except ConnectionResetError:
                chunk = b""
            except TimeoutError:
                raise Problem("job socket", f"no reply within {CALL_TIMEOUT} s", "") from None
            if not chunk:
                self.closed = True
                return None
            data += chunk
        return data

    def answer(self) -> pb.JobReply | None:
        """The reply to the request, skipping JobDone; None if the connection closed."""
        while True:
            reply = self.reply()
            if reply is None or not reply.HasField("job_done"):
                return reply


class Problem(Exception):
    def __init__(self, where: str, what: str, request: str):
        super().__init__(what)
        self.report = {"where": where, "what": what, "request": request[:3000]}


def encode(frame: pb.JobFrame) -> bytes:
    data = frame.SerializeToString()
    return JOB_FRAME_HEADER.pack(len(data)) + data


def check_refusal(reply: pb.JobReply, request: str) -> str:
    kind = reply.WhichOneof("kind")
    if kind == "refused":
        if reply.refused.code not in EXPECTED_NUMBERS:
            raise Problem("job socket", f"refused with code {reply.refused.code}: {reply.refused.message!r}", request)
        return f"refused:{grpc_name(reply.refused.code)}"
    return kind or "empty"


def grpc_name(number: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == number), str(number))


def run_job_script(state: State, script, counts: Counter) -> None:
    first, actions, cut_off = script
    probe = JobSocketProbe(state.job_socket)
    # Until raw bytes are sent the stream is in frames, and each frame is owed one answer.
    in_frames, ready = True, False
    try:
        for action, arg in [first, *actions]:
            if probe.closed:
                return
            if action in ("hello", "frame"):
                frame = pb.JobFrame(hello=pb.JobSocketHello(session_id=arg)) if action == "hello" else arg
                request = text_format.MessageToString(frame, as_one_line=True)
                data = encode(frame)
                probe.send(data)
                if not in_frames:
                    drain(probe, request, counts)
                    continue
                # A frame over the limit (a small one until the hello is taken) is not
                # answered: the daemon closes the connection, which is all it owes.
                limit = MAX_JOB_FRAME_BYTES if ready else MAX_HELLO_FRAME_BYTES
                if len(data) - JOB_FRAME_HEADER.size > limit:
                    if probe.answer() is not None:
                        raise Problem("job socket", f"answered a frame over the {limit}-byte limit", request)
                    counts["jobs closed: too large"] += 1
                    return
                reply = probe.answer()
                if reply is None:
                    raise Problem("job socket", "closed instead of answering a frame", request)
                if reply.request_id != frame.request_id:
                    raise Problem("job socket", f"answered request {reply.request_id} instead", request)
                outcome = check_refusal(reply, request)
                counts["jobs " + outcome] += 1
                if not ready and outcome == "staging_ready":
                    check_staging_without_descriptor(probe, request, counts)
                    return
                if not ready and outcome != "ready":
                    # Refused before its hello: the daemon closes the connection.
                    if probe.answer() is not None:
                        raise Problem("job socket", "a refused connection was left open", request)
                    return
                ready = True
            else:
                data = arg if action == "raw" else JOB_FRAME_HEADER.pack(arg[0]) + arg[1]
                in_frames = False
                probe.send(data)
                drain(probe, f"bytes {data[:200]!r}", counts)
        if cut_off:
            # Half a frame, then the connection closes.
            probe.send(JOB_FRAME_HEADER.pack(1000) + b"\x08" * 10)
    finally:
        probe.sock.close()


def check_staging_without_descriptor(probe: JobSocketProbe, request: str, counts: Counter) -> None:
    """After a staging offer is taken, the daemon reads one byte only, which
    must carry the descriptor: one without it is refused, and the connection closed."""
    probe.send(b"\0")
    reply = probe.answer()
    if reply is None or check_refusal(reply, request) != "refused:INVALID_ARGUMENT":
        raise Problem("job socket", f"a staging offer's byte without a descriptor was answered {reply}", request)
    if probe.answer() is not None:
        raise Problem("job socket", "a refused staging offer's connection was left open", request)
    counts["jobs staging refused: no descriptor"] += 1


def drain(probe: JobSocketProbe, request: str, counts: Counter) -> None:
    """Reads whatever the daemon answered to bytes that may or may not be frames."""
    probe.sock.settimeout(0.05)
    try:
        while not probe.closed:
            reply = probe.reply()
            if reply is None:
                counts["jobs closed"] += 1
                return
            counts["jobs garbage " + check_refusal(reply, request)] += 1
    except Problem as e:
        if "no reply" not in e.report["what"]:
            raise
    except Exception:  # a reply that does not parse: we sent half a frame's header, say
        pass
    finally:
        probe.sock.settimeout(CALL_TIMEOUT)


# ---------------------------------------------------------------- gRPC


def call(state: State, method, request, counts: Counter) -> None:
    text = f"{method.name} {text_format.MessageToString(request, as_one_line=True)}"
    try:
        if method.name == "Attach":
            stream = state.stub.Attach(request, timeout=CALL_TIMEOUT)
            try:
                first = next(stream)
                counts["Attach OK"] += 1
                if not first.HasField("started"):
                    raise Problem("Attach", "the first message is not `started`", text)
            finally:
                stream.cancel()
            return
        getattr(state.stub, method.name)(request, timeout=CALL_TIMEOUT)
    except grpc.RpcError as e:
        code = e.code()
        counts[f"{method.name} {code.name}"] += 1
        if code not in EXPECTED:
            raise Problem(method.name, f"{code.name}: {e.details()}", text) from None
        return
    counts[f"{method.name} OK"] += 1


def raw_call(state: State, channel, method, payload: bytes, counts: Counter) -> None:
    """Bytes that may not be the method's request type at all."""
    path = f"/{SERVICE.full_name}/{method.name}"
    text = f"{method.name} raw bytes {payload!r}"
    try:
        if method.name == "Attach":
            stream = channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT)
            try:
                next(stream)
            finally:
                stream.cancel()
        else:
            channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT)
    except grpc.RpcError as e:
        counts[f"raw {code_name(e)}"] += 1
        if e.code() not in EXPECTED:
            raise Problem(method.name, f"raw bytes: {e.code().name}: {e.details()}", text) from None
        return
    counts["raw OK"] += 1


def code_name(error: grpc.RpcError) -> str:
    return error.code().name


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("socket")
    parser.add_argument("--daemon-pid", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--garbage", action="store_true", help="only send bytes that parse as no message to each RPC")
    args = parser.parse_args()

    channel = grpc.insecure_channel("unix:" + args.socket)
    stub = pb_grpc.KVDepotStub(channel)
    state = State(stub, random.Random(args.seed))
    counts: Counter = Counter()
    problems: list[dict] = []
    methods = list(SERVICE.methods)
    if args.garbage:
        for method in methods:
            try:
                raw_call(state, channel, method, b"\xff\xff\xff", counts)
            except Problem as e:
                problems.append(e.report)
        return report(counts, problems)
    state.set_up()

    requests = st.one_of(*[request_strategy(m, state).map(lambda r, m=m: ("grpc", m, r)) for m in methods])
    raw = st.tuples(st.sampled_from(methods), st.binary(max_size=120)).map(lambda t: ("raw", *t))
    jobs = job_script(state).map(lambda s: ("jobs", None, s))
    # About 6 in 10 examples are calls, 1 raw bytes, 3 job socket connections.
    case = st.one_of(requests, requests, requests, requests, requests, requests, raw, jobs, jobs, jobs)

    @settings(max_examples=args.examples, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(args.seed)
    @given(case)
    def fuzz(case):
        where, method, payload = case
        try:
            if where == "grpc":
                call(state, method, payload, counts)
            elif where == "raw":
                raw_call(state, channel, method, payload, counts)
            else:
                run_job_script(state, payload, counts)
        except Problem as e:
            problems.append(e.report)
            if not alive(args.daemon_pid):
                raise SystemExit(report(counts, problems + [{"where": "daemon", "what": "the daemon died"}])) from None
        counts["examples"] += 1

    fuzz()
    if not alive(args.daemon_pid):
        problems.append({"where": "daemon", "what": "the daemon died"})
    state.close()
    return report(counts, problems)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def report(counts: Counter, problems: list[dict]) -> int:
    print(json.dumps({"counts": dict(sorted(counts.items())), "problems": problems}), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
