"""A client that tries to make the daemon hold more than it should, from a
process of its own, with raw gRPC and raw sockets (no client library). Run by
the tests; each command prints one JSON line, and those that hold something
keep it until a line comes on stdin.

  stuck-engine SOCKET N   attach, register N engines, read nothing from the stream
                          until told; then read it to its end and say how it ended
  idle SOCKET N           open N job socket connections and say nothing
  flood SOCKET MIB[:N]    attach N sessions (1), each says hello on a connection of its own;
                          when N > 1, say so and wait to be told; then send MIB MiB of
                          requests on each, read no reply
  garbage SOCKET N        N connections, each sends one frame that is no JobFrame
  forge SOCKET TEXT       attach with TEXT as client name and namespace model
  sparse SOCKET N         attach, say hello, hand over N sparse sealed memfds of 64 GiB
  grpc-idle SOCKET N:K    open N HTTP/2 connections to the gRPC socket that make no call and
                          answer every SETTINGS and PING; say how many are open once at most K
                          are (or after 30 s), and keep answering until told
  guess ADDRESS N         N GetStats calls one after the other over TCP, each with a wrong
                          token: their status codes and how long each took to be answered
  wait-flood SOCKET N:K   attach, say hello, and make N RegisterWorker calls at once (no
                          deadline) while the daemon's transport is still coming up; say how
                          many still wait once at most K do (or after 20 s), and how the others
                          were answered; when told, cancel them, make K + 1 again (until K of
                          them wait, at most 20 times) and say the same
  streams SOCKET N        on one connection, open N gRPC streams (HEADERS only) to the
                          reflection service; say what the daemon's SETTINGS allowed and
                          how many streams it refused
  unproven SOCKET N       attach N times, one after the other, never saying hello, each
                          stream cancelled once it started
  partial SOCKET N:MIB    N sessions, each with its job socket connection, each sends a frame
                          of MIB MiB but its last byte; say how many the daemon refused (and
                          its first refusal); hold the others until told
  whole SOCKET N:MIB      N sessions, each sends one whole frame of MIB MiB (a JobFrame that
                          asks nothing) and reads its answer; hold the connections until told
  watch SOCKET N:BYTES    open N health Watch streams on one connection, each for a service
                          name of BYTES characters; say how many were answered (and stay open)
                          and how the others ended; hold them until told
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcache import namespace  # noqa: E402
from raw_client import prove  # noqa: E402

from kvdepot.defaults import PROTOCOL_VERSION  # noqa: E402
from kvdepot.proto import kvdepot_pb2 as pb  # noqa: E402
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc  # noqa: E402

LENGTH = struct.Struct("<I")


def framed(message) -> bytes:
    data = message.SerializeToString()
    return LENGTH.pack(len(data)) + data


def attach(socket_path: str, name: str = "attacker", hello: bool = True):
    """A session; with `hello`, proven on the job socket (which closes again:
    the session keeps its identity)."""
    channel = grpc.insecure_channel("unix:" + socket_path)
    stub = pb_grpc.KVDepotStub(channel)
    stream = stub.Attach(pb.AttachRequest(client_name=name, pid=os.getpid(), protocol_version=PROTOCOL_VERSION))
    started = next(stream).started
    if hello:
        prove(started)
    return channel, stub, stream, started


def hold(report: dict) -> None:
    print(json.dumps(report), flush=True)
    sys.stdin.readline()


def stuck_engine(socket_path: str, engines: int) -> None:
    _, stub, stream, started = attach(socket_path, "stuck")
    for _ in range(engines):  # each is told every change of the namespace
        stub.RegisterEngine(pb.RegisterEngineRequest(session_id=started.session_id,
                                                     namespace=pb.NamespaceSpec(**namespace("per_layer"))))
    # The stream is not read: everything the daemon sends it waits.
    hold({"engines": engines})
    try:
        for _ in stream:
            pass
        print(json.dumps({"ended": "OK"}), flush=True)
    except grpc.RpcError as e:
        print(json.dumps({"ended": e.code().name, "details": e.details()}), flush=True)


def refusal_of(sock: socket.socket) -> str | None:
    """The JobRefused message the daemon sent before closing, or None while it keeps the connection."""
    try:
        header = sock.recv(LENGTH.size, socket.MSG_WAITALL | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return "reset"
    if len(header) < LENGTH.size:
        return "closed"
    reply = pb.JobReply()
    reply.ParseFromString(sock.recv(LENGTH.unpack(header)[0], socket.MSG_WAITALL))
    return f"{reply.refused.code} {reply.refused.message}"


def idle(socket_path: str, count: int) -> None:
    connections = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path + ".jobs")
        connections.append(sock)
    # The daemon's answers, until none came for a second (a loaded daemon
    # takes a while to reach the last connections of its backlog).
    answers: dict[int, str] = {}
    deadline, last = time.monotonic() + 20, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - last < 1:
        for i, sock in enumerate(connections):
            if i not in answers and (answer := refusal_of(sock)) is not None:
                answers[i], last = answer, time.monotonic()
        time.sleep(0.05)
    # Refused for a limit (RESOURCE_EXHAUSTED); not those a hello deadline closed since.
    refused = [answers[i] for i in sorted(answers) if answers[i].startswith("8 ")]
    hold({"opened": count, "refused": len(refused), "first_refusal": refused[0] if refused else None})


def flood(socket_path: str, mib: int, count: int = 1) -> None:
    held, socks = [], []
    for _ in range(count):
        held.append(attach(socket_path, "flood", hello=False))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path + ".jobs")
        sock.sendall(framed(pb.JobFrame(hello=pb.JobSocketHello(session_id=held[-1][3].session_id))))
        sock.setblocking(False)
        socks.append(sock)
    if count > 1:
        hold({"attached": count})
    # Each request is refused (it names no job): a small frame in, a larger reply out.
    chunk = b"".join(framed(pb.JobFrame(request_id=i + 1)) for i in range(65536))
    # Until it is sent, or the daemon has taken nothing for 2 s (it stopped reading, as it should).
    sent, progress = [0] * count, time.monotonic()
    while time.monotonic() - progress < 2:
        for i, sock in enumerate(socks):
            if sock is None or sent[i] >= mib << 20:
                continue
            try:
                offset = sent[i] % len(chunk)
                sent[i] += sock.send(chunk[offset:])
                progress = time.monotonic()
            except BlockingIOError:
                pass
            except OSError as e:  # the daemon closed it
                print(f"the daemon closed the connection: {e!r}", file=sys.stderr, flush=True)
                socks[i] = None
        if all(s is None or n >= mib << 20 for s, n in zip(socks, sent)):
            break
        time.sleep(0.01)
    hold({"sent_mib": sum(sent) / 2**20})


def unproven(socket_path: str, count: int) -> None:
    channel = grpc.insecure_channel("unix:" + socket_path)
    stub = pb_grpc.KVDepotStub(channel)
    for _ in range(count):
        stream = stub.Attach(pb.AttachRequest(client_name="unproven", pid=os.getpid(),
                                              protocol_version=PROTOCOL_VERSION))
        next(stream)
        stream.cancel()
    channel.close()
    print(json.dumps({"attached": count}), flush=True)


def garbage(socket_path: str, count: int) -> None:
    for i in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path + ".jobs")
        sock.sendall(LENGTH.pack(3) + b"\xff\xff\xff" if i % 2 else LENGTH.pack(1 << 30))
        sock.settimeout(10)
        try:
            sock.recv(1)
        except OSError:
            pass
        sock.close()
    print(json.dumps({"sent": count}), flush=True)


def forge(socket_path: str, text: str) -> None:
    channel, stub, stream, started = attach(socket_path, text)
    spec = pb.NamespaceSpec(**{**namespace("per_layer"), "model": text})
    try:  # refused (a model name must be printable); either way nothing may reach the log raw
        stub.RegisterEngine(pb.RegisterEngineRequest(session_id=started.session_id, namespace=spec))
    except grpc.RpcError:
        pass
    stream.cancel()
    channel.close()
    print(json.dumps({"attached": True}), flush=True)


def sparse(socket_path: str, count: int) -> None:
    from raw_client import RawSession

    from kvdepot.client.job_socket import hand_over

    session = RawSession(socket_path, name="sparse")
    taken, refusal = 0, None
    for _ in range(count):
        fd = os.memfd_create("sparse", os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 64 << 30)  # costs nothing: no page is ever touched
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            hand_over(session.started.job_socket, session.id, fd, 10)
            taken += 1
        except Exception as e:
            refusal = str(e)
            break
        finally:
            os.close(fd)
    hold({"taken": taken, "refusal": refusal})
    session.close()


def partial(socket_path: str, count: int, mib: int) -> None:
    from raw_client import RawSession

    sessions, refused = [], []
    for i in range(count):
        session = RawSession(socket_path, name=f"partial{i}")
        sessions.append(session)
        session.jobs.sock.settimeout(30)
        try:
            session.jobs.sock.sendall(LENGTH.pack(mib << 20) + b"\0" * ((mib << 20) - 1))
        except OSError:  # it closed the connection while we sent
            pass
        session.jobs.sock.settimeout(None)  # refusal_of asks without waiting
    time.sleep(0.5)
    for session in sessions:
        if (answer := refusal_of(session.jobs.sock)) is not None:
            refused.append(answer)
    hold({"held": count - len(refused), "refused": len(refused), "first_refusal": refused[0] if refused else None})


def whole(socket_path: str, count: int, mib: int) -> None:
    from raw_client import RawSession

    # Request id 1 and an unknown field (number 1000, length-delimited) of
    # MIB MiB: a JobFrame every reader skips over to find it asks nothing.
    body = (mib << 20) - 16
    frame = b"\x08\x01" + b"\xc2\x3e" + varint(body) + b"\0" * body
    sessions, answers = [], []
    for i in range(count):
        session = RawSession(socket_path, name=f"whole{i}")
        sessions.append(session)
        session.jobs.sock.settimeout(30)
        session.jobs.sock.sendall(LENGTH.pack(len(frame)) + frame)
        reply = session.jobs.reply()
        answers.append(None if reply is None else reply.WhichOneof("kind"))
    hold({"answers": answers})


def varint(n: int) -> bytes:
    out = b""
    while n >= 0x80:
        out += bytes([n & 0x7F | 0x80])
        n >>= 7
    return out + bytes([n])


def wait_flood(socket_path: str, count: int, keep: int) -> None:
    from kvcache import make_kv_cache
    from raw_client import cpu_worker_request

    channel, stub, stream, started = attach(socket_path, "wait-flood")
    request, _ = cpu_worker_request(started.session_id, namespace("per_layer"), *make_kv_cache("per_layer", seed=1))

    def flood(n: int) -> tuple[list, dict]:
        calls = [stub.RegisterWorker.future(request) for _ in range(n)]
        deadline = time.monotonic() + 20
        while sum(not c.done() for c in calls) > keep and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # any the daemon would still answer
        codes, refusal = {}, None
        for c in calls:
            if c.done():
                codes[c.code().name] = codes.get(c.code().name, 0) + 1
                if c.code() != grpc.StatusCode.OK:
                    refusal = c.details()
        return calls, {"waiting": sum(not c.done() for c in calls), "codes": codes, "refusal": refusal}

    calls, report = flood(count)
    hold(report)
    for c in calls:
        c.cancel()
    # Until the daemon has seen them cancelled (a loaded machine takes a while),
    # or its count never comes back down and the last try says so.
    for _ in range(20):
        time.sleep(0.5)
        calls, report = flood(keep + 1)
        if report["waiting"] == keep:
            break
        for c in calls:
            c.cancel()
    print(json.dumps(report), flush=True)
    for c in calls:
        c.cancel()
    stream.cancel()
    channel.close()


def watch(socket_path: str, count: int, size: int) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel("unix:" + socket_path)
    stub = health_pb2_grpc.HealthStub(channel)
    streams = [stub.Watch(health_pb2.HealthCheckRequest(service=f"{i:08d}".ljust(size, "x")[:size] if size else ""))
               for i in range(count)]
    report = {"open": 0, "codes": {}, "refusal": None}
    for stream in streams:
        try:
            next(stream)
            report["open"] += 1
        except grpc.RpcError as e:
            report["codes"][e.code().name] = report["codes"].get(e.code().name, 0) + 1
            report["refusal"] = e.details()
    hold(report)
    for stream in streams:
        stream.cancel()
    channel.close()


def h2_frame(kind: int, flags: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + (0).to_bytes(4, "big") + payload


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2_frame(4, 0, b"")


def answer_h2(sock: socket.socket, buf: bytes) -> bytes:
    """Acknowledges every SETTINGS and PING among the whole frames in `buf`, as
    an HTTP/2 client that makes no call; returns what is left of `buf`."""
    while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
        length, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
        payload, buf = buf[9:9 + length], buf[9 + length:]
        if kind in (4, 6) and not flags & 1:
            sock.sendall(h2_frame(kind, 1, b"" if kind == 4 else payload))
    return buf


def streams(socket_path: str, count: int) -> None:
    def literal(name: bytes, value: bytes) -> bytes:
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

    headers = b"".join(literal(n, v) for n, v in (
        (b":method", b"POST"), (b":scheme", b"http"),
        (b":path", b"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"),
        (b":authority", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers")))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    sock.sendall(H2_PREFACE)
    for first in range(0, count, 256):  # HEADERS with END_HEADERS, never a DATA frame
        sock.sendall(b"".join(len(headers).to_bytes(3, "big") + bytes([1, 4]) + (2 * i + 1).to_bytes(4, "big")
                              + headers for i in range(first, min(count, first + 256))))
    settings: dict[int, int] = {}
    refused, buf = 0, b""
    sock.settimeout(0.5)
    deadline, last = time.monotonic() + 30, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - last < 2:
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            continue
        if not data:
            break
        buf, last = buf + data, time.monotonic()
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            length, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
            payload = buf[9:9 + length]
            if kind == 4 and not flags & 1:
                for at in range(0, len(payload) - 5, 6):
                    settings[int.from_bytes(payload[at:at + 2], "big")] = int.from_bytes(payload[at + 2:at + 6], "big")
            if kind == 3:
                refused += 1
            buf = answer_h2(sock, buf[:9 + length]) + buf[9 + length:]
    # 0x3: SETTINGS_MAX_CONCURRENT_STREAMS (absent: no limit)
    hold({"max_concurrent_streams": settings.get(3), "refused": refused})
    sock.close()


def grpc_idle(socket_path: str, count: int, keep: int) -> None:
    import selectors
    import threading

    selector = selectors.DefaultSelector()
    pending: dict[socket.socket, bytes] = {}
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(socket_path)
            sock.sendall(H2_PREFACE)
        except OSError:  # shut down by the daemon already
            sock.close()
            continue
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        pending[sock] = b""
    done = threading.Event()

    def drop(sock: socket.socket) -> None:
        selector.unregister(sock)
        del pending[sock]
        sock.close()

    def serve() -> None:
        while not done.is_set():
            for key, _ in selector.select(0.1):
                sock = key.fileobj
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    drop(sock)
                    continue
                try:
                    pending[sock] = answer_h2(sock, pending[sock] + data)
                except OSError:
                    drop(sock)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while len(pending) > keep and time.monotonic() < deadline:
        time.sleep(0.05)
    hold({"opened": count, "open": len(pending)})
    done.set()
    thread.join()
def guess(address: str, count: int) -> None:
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.KVDepotStub(channel)
    codes, seconds = [], []
    for i in range(count):
        started = time.monotonic()
        try:
            stub.GetStats(pb.GetStatsRequest(), metadata=[("authorization", f"Bearer guess-{i}")], timeout=30)
            codes.append("OK")
        except grpc.RpcError as e:
            codes.append(e.code().name)
        seconds.append(time.monotonic() - started)
    channel.close()
    print(json.dumps({"codes": codes, "seconds": seconds}), flush=True)


def main() -> int:
    command, socket_path, arg = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""
    if command == "stuck-engine":
        stuck_engine(socket_path, int(arg))
    elif command == "idle":
        idle(socket_path, int(arg))
    elif command == "flood":
        mib, _, count = arg.partition(":")
        flood(socket_path, int(mib), int(count or 1))
    elif command == "garbage":
        garbage(socket_path, int(arg))
    elif command == "unproven":
        unproven(socket_path, int(arg))
    elif command == "streams":
        streams(socket_path, int(arg))
    elif command == "grpc-idle":
        count, keep = arg.split(":")
        grpc_idle(socket_path, int(count), int(keep))
    elif command == "sparse":
        sparse(socket_path, int(arg))
    elif command == "forge":
        forge(socket_path, arg)
    elif command == "wait-flood":
        count, keep = arg.split(":")
        wait_flood(socket_path, int(count), int(keep))
    elif command in ("partial", "whole"):
        count, mib = arg.split(":")
        (partial if command == "partial" else whole)(socket_path, int(count), int(mib))
    elif command == "watch":
        count, size = arg.split(":")
        watch(socket_path, int(count), int(size))
    elif command == "guess":
        guess(socket_path, int(arg))
    else:
        raise SystemExit(f"unknown command {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
