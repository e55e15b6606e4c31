"""kvdepot: the operator's command line (stats, health, clear).

What a caller may see and clear depends on who it is. On a unix socket the
daemon learns that from a session's job socket (proto: "job socket"), so the
CLI opens a session of its own first; on TCP the token says it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot import kept_pools
from kvdepot.client.daemon_identity import check_daemon, daemon_uids_setting, trusted_uids
from kvdepot.client.job_socket import JobSocket
from kvdepot.client.rpc import Tls, open_channel
from kvdepot.client.watch import block_size, holds_lines, numa_lines
from kvdepot.defaults import PROTOCOL_VERSION, default_socket_path, grpc_target, read_token
from kvdepot.errors import KVDepotError, Unavailable, from_rpc_error
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc

SERVICE_NAME = "kvdepot.v1.KVDepot"


def message_to_dict(message: Message) -> dict:
    """Every field, defaults included, with integers kept as JSON numbers.

    (protobuf's own JSON mapping writes 64-bit integers as strings.)
    """
    result = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            # A map of scalars (TierStats.discarded): a JSON object.
            result[fd.name] = dict(value)
        elif fd.message_type is not None:
            if fd.is_repeated:
                result[fd.name] = [message_to_dict(v) for v in value]
            else:
                result[fd.name] = message_to_dict(value)
        elif fd.enum_type is not None:
            result[fd.name] = fd.enum_type.values_by_number[value].name
        elif fd.is_repeated:
            result[fd.name] = list(value)
        else:
            result[fd.name] = value
    return result


class OperatorClient:
    def __init__(
        self, target: str, auth_token: str | None = None, timeout: float = 5.0, tls: Tls | None = None,
        daemon_uids=None,
    ):
        self.target = grpc_target(target)
        self._trusted = trusted_uids(daemon_uids_setting(daemon_uids))
        checked = check_daemon(self.target, self._trusted, timeout)
        self._channel = open_channel(checked, tls.credentials() if tls is not None else None)
        self._stub = pb_grpc.KVDepotStub(self._channel)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._timeout = timeout
        self._attach = None
        self._job_socket = None
        self._session_id = ""

    def _session(self) -> str:
        """A proven session's id on a unix socket; empty on TCP."""
        if self._session_id or not self.target.startswith("unix:"):
            return self._session_id
        request = pb.AttachRequest(client_name="kvdepot-cli", pid=os.getpid(), protocol_version=PROTOCOL_VERSION)
        self._attach = attach = self._stub.Attach(request, metadata=self._metadata)
        # The stream has no deadline (a session lasts while it is open): its first
        # message gets --timeout, so that a wedged daemon cannot hold the command.
        gave_up = threading.Event()
        timer = threading.Timer(self._timeout, lambda: (gave_up.set(), attach.cancel()))
        timer.daemon = True
        timer.start()
        try:
            started = next(attach).started
        except grpc.RpcError as e:
            if gave_up.is_set():
                raise Unavailable(f"kvdepotd on {self.target} did not start a session within {self._timeout:g} s "
                                  "(--timeout)") from None
            raise from_rpc_error(e) from None
        finally:
            timer.cancel()
        try:
            self._job_socket = JobSocket(
                started.job_socket, started.session_id, lambda reply: None, lambda reason: None, self._timeout,
                self._trusted,
            )
        except OSError as e:
            raise Unavailable(f"cannot say hello on the job socket {started.job_socket}: {e}") from None
        self._session_id = started.session_id
        return self._session_id

    def _call(self, method, request):
        try:
            return method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def stats(self) -> pb.GetStatsResponse:
        return self._call(self._stub.GetStats, pb.GetStatsRequest(session_id=self._session()))

    def clear(self, namespace_name: str = "") -> pb.ClearResponse:
        request = pb.ClearRequest(namespace_name=namespace_name, session_id=self._session())
        return self._call(self._stub.Clear, request)

    def health(self) -> str:
        stub = health_pb2_grpc.HealthStub(self._channel)
        response = self._call(stub.Check, health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        if self._job_socket is not None:
            self._job_socket.close()
        if self._attach is not None:
            self._attach.cancel()
        self._channel.close()


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _tier_line(tier: pb.TierStats) -> str:
    line = (
        f"{'tier ' + tier.name:<9} {tier.shards} shards, {_gib(tier.bytes)} of {_gib(tier.capacity_bytes)}"
    )
    if tier.name == "dram":
        line += f"; {tier.recovered_shards} adopted at start"
    elif tier.circuit:  # the remote store: what it holds is not known here
        fetched = sum(tier.fetch_counts)
        mean = f", {tier.fetch_seconds / fetched * 1000:.1f} ms a fetch" if fetched else ""
        line = (
            f"{'tier ' + tier.name:<9} store {tier.circuit}; {tier.written_shards} published "
            f"({_gib(tier.written_bytes)}, {tier.dropped_writes} dropped), {tier.promotions} hits "
            f"({_gib(tier.read_bytes)}{mean}), {tier.misses} misses, {tier.failed_promotions} failed"
        )
        if tier.write_errors:
            line += f", {tier.write_errors} store errors"
    else:
        line += (
            f", {'O_DIRECT' if tier.direct_io else 'buffered'}; {tier.written_shards} written, "
            f"{tier.promotions} promoted ({tier.failed_promotions} failed), {tier.evicted_shards} evicted, "
            f"{tier.recovered_shards} found at start"
        )
        if tier.write_errors:
            line += f", {tier.write_errors} write errors"
    if tier.discarded:
        line += "; discarded: " + ", ".join(f"{n} {reason}" for reason, n in sorted(tier.discarded.items()))
    return line


def format_stats(stats: pb.GetStatsResponse) -> str:
    pool = stats.pool
    t = stats.totals
    lines = [
        f"kvdepotd {stats.daemon_version} (instance {stats.daemon_instance}), up {stats.uptime_seconds:.0f} s",
        f"pool      {_gib(pool.slot_bytes * pool.num_slots)} in {pool.num_slots} slots of "
        f"{pool.slot_bytes} B, {'pinned' if pool.pinned else 'not pinned'}"
        + (f"; coming up: {_gib(pool.slot_bytes * pool.online_slots)} up so far"
           if 0 < pool.online_slots < pool.num_slots and not pool.bring_up_error else "")
        + (f"; only {_gib(pool.slot_bytes * pool.online_slots)} came up: {pool.bring_up_error}"
           if pool.bring_up_error else ""),
        f"occupancy {100 * stats.occupancy:.1f}% ({stats.used_slots} slots used, "
        f"{stats.pinned_slots} pinned by jobs), eviction {stats.eviction_policy}",
        f"lookups   {t.lookups}: {t.hit_blocks} blocks hit, {t.miss_blocks} missed",
        f"stored    {t.stored_blocks} blocks, {_gib(t.stored_bytes)}, {t.store_gbps:.2f} GB/s",
        f"loaded    {t.loaded_blocks} blocks, {_gib(t.loaded_bytes)}, {t.load_gbps:.2f} GB/s",
        f"evicted   {t.evicted_blocks} blocks; {t.failed_jobs} failed jobs; "
        f"{stats.sessions_ended} sessions ended",
    ]
    lines += holds_lines(stats)
    for tier in stats.tiers:
        lines.append(_tier_line(tier))
    lines += numa_lines(stats)
    if stats.totals.disk_hit_blocks:
        lines.append(f"hits      {t.hit_blocks - t.disk_hit_blocks} from DRAM, {t.disk_hit_blocks} from disk")
    for gpu in stats.gpus:
        lines.append(f"gpu {gpu.index}     daemon holds {gpu.daemon_memory_bytes / 2**20:.0f} MiB ({gpu.uuid})")
    lines.append("")
    header = (
        f"{'namespace':<48} {'ready':>8} {'slots':>8} {'block':>10} {'KV':>10} {'hits':>8} {'misses':>8} "
        f"{'stored':>8} {'loaded':>8} {'evicted':>8}"
    )
    lines.append(header)
    for ns in stats.namespaces:
        c = ns.counters
        lines.append(
            f"{ns.name:<48} {ns.ready_blocks:>8} {ns.used_slots:>8} {block_size(ns.block_bytes):>10} "
            f"{_gib(ns.used_bytes).replace(' GiB', 'G'):>10} {c.hit_blocks:>8} {c.miss_blocks:>8} "
            f"{c.stored_blocks:>8} {c.loaded_blocks:>8} {c.evicted_blocks:>8}"
        )
    if not stats.namespaces:
        lines.append("(no namespaces yet)")
    lines.append("")
    lines.append(
        f"{'client':<32} {'tenant':<16} {'pid':>8} {'workers':>8} {'in flight':>10} {'hits':>8} {'stored':>8} "
        f"{'loaded':>8}"
    )
    for client in stats.clients:
        c = client.counters
        lines.append(
            f"{client.client_name[:32]:<32} {client.tenant:<16} {client.pid:>8} {client.workers:>8} "
            f"{client.jobs_in_flight:>10} "
            f"{c.hit_blocks:>8} {c.stored_blocks:>8} {c.loaded_blocks:>8}"
        )
    if not stats.clients:
        lines.append("(no clients attached)")
    return "\n".join(lines)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvdepot", description="Operate a running kvdepotd.")
    parser.add_argument(
        "--socket",
        default=None,
        help="the daemon's address: socket path, unix:PATH or HOST:PORT "
        f"(default: $KVDEPOT_SOCKET or {default_socket_path()})",
    )
    parser.add_argument(
        "--auth-token-file",
        default=os.environ.get("KVDEPOT_AUTH_TOKEN_FILE"),
        help="token file for a TCP daemon (also $KVDEPOT_AUTH_TOKEN_FILE)",
    )
    for name, what in (("ca", "CA certificates of a TCP daemon's certificate (default: the system's)"),
                       ("cert", "this client's certificate, for a daemon that asks for one"),
                       ("key", "the key of --tls-cert-file")):
        parser.add_argument(
            f"--tls-{name}-file", default=os.environ.get(f"KVDEPOT_TLS_{name.upper()}_FILE"),
            help=f"{what} (also $KVDEPOT_TLS_{name.upper()}_FILE); any of these turns TLS on",
        )
    parser.add_argument(
        "--daemon-uids", default=None, metavar="UID,...",
        help="uids besides root and your own whose daemon this command may talk to on a unix socket "
        "(default: $KVDEPOT_DAEMON_UIDS)",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    commands = parser.add_subparsers(dest="command", required=True)
    stats = commands.add_parser("stats", help="cache statistics: hits, bytes, occupancy, per namespace and client")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.add_argument(
        "--watch", nargs="?", const=2.0, type=_seconds, metavar="SECONDS",
        help="refresh every SECONDS (default 2) with rates, like top, until Ctrl-C",
    )
    commands.add_parser("health", help="exit 0 if the daemon is serving, 1 otherwise")
    clear = commands.add_parser("clear", help="drop the cached blocks of a namespace, or of all")
    target = clear.add_mutually_exclusive_group(required=True)
    target.add_argument("namespace", nargs="?", help="namespace name as `kvdepot stats` shows it")
    target.add_argument("--all", action="store_true", help="clear every namespace")
    pools = commands.add_parser(
        "pools", help="this user's pools kept in RAM by stopped daemons: their address and age (no daemon needed)")
    pools.add_argument("--pool-dir", action="append", default=[],
                       help="a folder to look in besides /dev/shm, /tmp and the socket's folder (repeatable)")
    pools.add_argument("--discard", metavar="PATH", help="remove this kept pool (never one a live daemon serves)")
    pools.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _pools(args) -> int:
    """`kvdepot pools`: lists this user's pool files, or discards one."""
    target = grpc_target(args.socket or default_socket_path())
    socket_dir = os.path.dirname(target[len("unix:"):]) if target.startswith("unix:") else ""
    folders = [*args.pool_dir, "/dev/shm", "/tmp", socket_dir]
    found = kept_pools.kept_pools([d for d in folders if d and os.path.isdir(d)])
    if args.discard:
        target = os.path.realpath(args.discard)
        pool = next((p for p in found if os.path.realpath(p.path) == target), None)
        if pool is None:
            print(f"kvdepot: {args.discard} is not a pool file of this user in {', '.join(folders)} "
                  "(--pool-dir adds a folder)", file=sys.stderr)
            return 1
        if pool.live:
            print(f"kvdepot: {pool.path} is served by a live daemon on {pool.address}: stop it first",
                  file=sys.stderr)
            return 1
        try:
            kept_pools.discard(pool.path)
        except OSError as e:
            print(f"kvdepot: cannot remove {pool.path}: {e.strerror}", file=sys.stderr)
            return 1
        print(f"discarded {pool.path} ({pool.bytes / 2**30:.2f} GiB, kept for {pool.address or 'an unknown address'})")
        return 0
    if args.json:
        print(json.dumps([{"path": p.path, "bytes": p.bytes, "address": p.address, "since": p.since,
                           "age_seconds": round(p.age()), "live": p.live, "unreadable": p.unreadable}
                          for p in found], indent=2))
        return 0
    if not found:
        print("(no pool files of this user)")
    for p in found:
        state = "served now" if p.live else f"kept {p.age() / 60:.0f} min"
        print(f"{p.path}  {p.bytes / 2**30:.2f} GiB  {p.address or '(address unknown: ' + p.unreadable + ')'}  "
              f"{state}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        code = _command(argv)
        # Flushed here, inside the try: left to the interpreter's exit, a
        # closed pipe would fail there, as "Exception ignored ... BrokenPipeError".
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader of stdout has gone (`kvdepot stats --watch 1 | head -20`).
        # That ends the command quietly, as a closed pipe ends other Unix
        # tools; exit 0, for closing the pipe is how a piped view is stopped,
        # as Ctrl-C (exit 0) stops it on a terminal. The watch's own cleanup
        # (the terminal's echo, the session) has run as the error passed.
        # What is still buffered goes to /dev/null, not to a second error at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def _command(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "pools":
        return _pools(args)
    if args.command == "stats" and args.watch is not None and args.json:
        parser.error("--watch shows a table; for JSON, run `kvdepot stats --json` at each interval")
    token = None
    if args.auth_token_file:
        try:
            token = read_token(args.auth_token_file)
        except ValueError as e:
            print(f"kvdepot: {e}", file=sys.stderr)
            return 2
    tls = None
    if args.tls_ca_file or args.tls_cert_file:
        tls = Tls(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)

    def connect() -> OperatorClient:
        uids = None if args.daemon_uids is None else [u for u in args.daemon_uids.split(",") if u.strip()]
        return OperatorClient(args.socket or default_socket_path(), token, args.timeout, tls, uids)

    try:
        client = connect()
    except KVDepotError as e:
        print(f"kvdepot: {e}", file=sys.stderr)
        return 2
    if args.command == "stats" and args.watch is not None:
        from kvdepot.client.watch import run as watch

        try:
            return watch(connect, client.target, args.watch, client)
        except KeyboardInterrupt:  # Ctrl-C before the view's own handling began
            return 0
    try:
        if args.command == "stats":
            stats = client.stats()
            print(json.dumps(message_to_dict(stats), indent=2) if args.json else format_stats(stats))
        elif args.command == "health":
            status = client.health()
            print(status)
            return 0 if status == "SERVING" else 1
        elif args.command == "clear":
            response = client.clear("" if args.all else args.namespace)
            print(f"cleared {response.cleared_blocks} block(s); {response.pinned_blocks} kept, pinned by jobs")
    except KVDepotError as e:
        print(f"kvdepot: {client.target}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
