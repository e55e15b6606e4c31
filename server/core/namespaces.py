"""Namespaces: what makes KV content incompatible, checked and named.

Blocks of two engines meet only when every field of their NamespaceSpec is
equal; the name is what `kvdepot stats` shows and `kvdepot clear` takes.

A namespace lives while an engine or worker is registered in it or a block of
it is in the index; then it is freed (its counters with it), so that clients
that come and go with ever new namespaces leave nothing behind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvdepot.errors import InvalidArgument, NotFound, ResourceExhausted
from kvdepot.layout import WorkerLayout
from kvdepot.server.core.counters import Counters
from kvdepot.server.core.limits import Limits, shown
from kvdepot.server.core.requests import NamespaceSpec
from kvdepot.server.host.shard_record import ns_digest


@dataclass(eq=False)
class Namespace:
    id: int
    name: str
    tp_size: int
    # The tenant, or sharing group of tenants, it belongs to (server/core/tenants.py).
    scope: str
    counters: Counters = field(default_factory=Counters)
    # Layout signature of each rank's shard, fixed by the first worker of that rank.
    rank_signatures: dict[int, tuple] = field(default_factory=dict)
    ready_blocks: int = 0
    used_slots: int = 0
    # Bytes of one block of one rank, as its workers (or the blocks adopted or
    # promoted into it) gave them; 0 until one did.
    block_bytes: int = 0
    # Engines and workers registered in it.
    registrations: int = 0
    identity: tuple = ()
    # What records in the tiers name it by (host/shard_record.py).
    digest: bytes = b""

    def check_rank_layout(self, rank: int, layout: WorkerLayout) -> None:
        known = self.rank_signatures.get(rank)
        if known is not None and known != layout.signature():
            raise InvalidArgument(
                f"rank {rank} of namespace {self.name!r} was registered with another "
                "layout (dtype, page sizes or pages per block differ): engines that share a "
                "namespace must share the KV layout"
            )

    def fix_rank_layout(self, rank: int, layout: WorkerLayout) -> None:
        self.rank_signatures[rank] = layout.signature()
        self.note_block_bytes(layout.block_bytes)

    def note_block_bytes(self, nbytes: int) -> None:
        self.block_bytes = max(self.block_bytes, nbytes)


def _identity(spec: NamespaceSpec, scope: str) -> tuple:
    return (
        scope,
        spec.model,
        spec.revision,
        spec.kv_dtype,
        spec.block_size,
        spec.layout,
        spec.tp_size,
        spec.kv_group,
        spec.extra,
        spec.key_version,
    )


def _name(spec: NamespaceSpec, scope: str) -> str:
    """scope/model@revision, then what an operator tells engines apart by, then
    a digest of `extra` (KV heads, head size, layers...): short, and one per identity."""
    name = f"{scope}/{spec.model}" + (f"@{spec.revision}" if spec.revision else "")
    name += f":{spec.kv_dtype or '-'}:bs{spec.block_size}:{spec.layout or '-'}"
    name += f":tp{spec.tp_size}:g{spec.kv_group}:k{spec.key_version}"
    return name + (":" + hashlib.sha256(spec.extra.encode()).hexdigest()[:8] if spec.extra else "")


def _check(spec: NamespaceSpec, limits: Limits) -> None:
    limits.check_namespace(spec)
    if not spec.model:
        raise InvalidArgument("namespace.model is required")
    if spec.block_size < 1:
        raise InvalidArgument("namespace.block_size must be at least 1")
    if spec.tp_size < 1:
        raise InvalidArgument("namespace.tp_size must be at least 1")
    if spec.key_version < 1:
        raise InvalidArgument(
            "namespace.key_version is required: the version of the block-key definition "
            "the client's keys follow (docs/keys.md)"
        )


class Namespaces:
    """Every live namespace, by identity."""

    def __init__(
        self,
        new_id: Callable[[], int],
        on_create: Callable[[Namespace], None] = lambda ns: None,
        limits: Limits | None = None,
        holds_blocks: Callable[[Namespace], bool] = lambda ns: ns.used_slots > 0 or ns.ready_blocks > 0,
        on_free: Callable[[Namespace], None] = lambda ns: None,
    ):
        self._new_id = new_id
        self._on_create = on_create
        self._limits = limits or Limits()
        # Whether a namespace's blocks are in the index (the lane that holds them says).
        self._holds_blocks = holds_blocks
        self._on_free = on_free
        self._by_identity: dict[tuple, Namespace] = {}
        # Namespaces with no registration: freed once their last block is gone.
        self._idle: set[Namespace] = set()

    def of(self, spec: NamespaceSpec, scope: str) -> Namespace:
        """The namespace of `spec` in `scope`, created on first use; InvalidArgument
        for a bad spec. It stays idle (freed when it holds no block) until acquired."""
        _check(spec, self._limits)
        identity = _identity(spec, scope)
        ns = self._by_identity.get(identity)
        if ns is None:
            if len(self._by_identity) >= self._limits.max_namespaces and not self.sweep():
                raise ResourceExhausted(
                    f"the daemon holds {len(self._by_identity)} namespaces, the most it may "
                    f"(--max-namespaces {self._limits.max_namespaces})"
                )
            held = sum(1 for known in self._by_identity.values() if known.scope == scope)
            if held >= self._limits.max_namespaces_per_tenant:
                self.sweep()
                held = sum(1 for known in self._by_identity.values() if known.scope == scope)
            if held >= self._limits.max_namespaces_per_tenant:
                raise ResourceExhausted(
                    f"tenant {scope} holds {held} namespaces, the most one tenant may "
                    f"(--max-namespaces-per-tenant {self._limits.max_namespaces_per_tenant})"
                )
            ns = Namespace(
                id=self._new_id(), name=_name(spec, scope), tp_size=spec.tp_size, scope=scope, identity=identity,
                digest=ns_digest(identity),
            )
            self._by_identity[identity] = ns
            self._idle.add(ns)
            self._on_create(ns)
        return ns

    def acquire(self, ns: Namespace) -> None:
        """An engine or worker has registered in `ns`."""
        ns.registrations += 1
        self._idle.discard(ns)

    def release(self, ns: Namespace) -> None:
        """An engine or worker of `ns` is gone (its session ended)."""
        ns.registrations -= 1
        if ns.registrations == 0:
            self._idle.add(ns)

    def sweep(self) -> int:
        """Frees the idle namespaces that hold no block; returns how many."""
        empty = [ns for ns in self._idle if not self._holds_blocks(ns)]
        for ns in empty:
            self._idle.discard(ns)
            del self._by_identity[ns.identity]
            self._on_free(ns)
        return len(empty)

    def __len__(self) -> int:
        return len(self._by_identity)

    def named(self, name: str, visible: Callable[[Namespace], bool]) -> Namespace:
        """The namespace called `name` among those `visible` says the caller may see."""
        for ns in self._by_identity.values():
            if ns.name == name and visible(ns):
                return ns
        # Other tenants' names are not listed: they would tell what those tenants serve.
        raise NotFound(f"no namespace {shown(name)} that this client may see: `kvdepot stats` lists them")

    def __iter__(self) -> Iterator[Namespace]:
        return iter(self._by_identity.values())


def gone_from_dram(gone: set[tuple[bytes, bytes]], namespaces: Namespaces, in_dram) -> list[tuple[Namespace, bytes]]:
    """Of the (namespace digest, key) pairs a tier no longer holds, the blocks
    DRAM does not hold either (`in_dram(ns, key)`): gone for good."""
    keys: dict[bytes, list[bytes]] = {}
    for digest, key in gone:
        keys.setdefault(digest, []).append(key)
    return [(ns, key) for ns in namespaces for key in keys.get(ns.digest, ()) if not in_dram(ns, key)]


def kept_namespace(namespaces: Namespaces, kept, known: dict | None = None) -> Namespace:
    """The namespace of a block adopted from the kept pool (a core/tiers.py
    KeptBlock), with its ranks' signatures as its first workers fixed them;
    raises when it is refused now (a worker of another layout may have
    registered while it waited for its chunk). `known`: the namespaces this
    found for earlier blocks of one restore (which holds their KeptBlocks, so
    the ids stay theirs): blocks of one namespace share their spec and their
    signatures' dict, so a chunk of them is looked up and checked once, not
    once a block."""
    mark = (id(kept.spec), kept.scope, id(kept.signatures))
    ns = known.get(mark) if known is not None else None
    if ns is None:
        ns = namespaces.of(kept.spec, kept.scope)
        for rank, signature in kept.signatures.items():
            if signature is not None and ns.rank_signatures.setdefault(rank, signature) != signature:
                raise ValueError(f"rank {rank} of namespace {ns.name!r} has a worker of another layout now")
        if known is not None:
            known[mark] = ns
    ns.note_block_bytes(max(kept.lengths, default=0))
    return ns
