"""The remote tier: blocks shared by a fleet's daemons through one Valkey or
Redis store, below DRAM and disk (docs/remote.md). Only scopes with a remote
secret (`secrets_of`) publish or fetch.

Publishing: every shard DRAM commits is queued once (remote_queue.py), read
out of its pinned slot, sealed on a thread (remote_format.py) and SET NX; a
full queue drops it, so an engine never waits on the network.

Fetching: a lookup that misses DRAM awaits `find` (STRLEN of every rank of the
leading run); the index then promotes what the store has as from the disk:
GETRANGE of every rank, each value checked on a thread before a byte reaches
a slot, and any failure is a miss. A breaker (breaker.py) skips a failing store.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time

from kvdepot.server.core.tiers import Tier, TierStats
from kvdepot.server.tiers import remote_format as fmt
from kvdepot.server.tiers.breaker import CLOSED, Breaker
from kvdepot.server.tiers.remote_queue import PublishQueue
from kvdepot.thread_names import name_os_thread

log = logging.getLogger("kvdepot.tiers")

# Blocks one lookup asks the store about, at most (the leading run).
MAX_FIND_RUN = 256
# What the tier remembers the store holds, and for how long: a block the store
# evicted under maxmemory since is a failed promotion, a miss.
MAX_KNOWN = 1 << 16
PRESENT_TTL_S = 60.0
# A miss is remembered briefly: another node may publish the block soon.
ABSENT_TTL_S = 1.0
# A value that failed its checks longer: it stays in the store (SET NX keeps it).
REJECTED_TTL_S = 60.0
# Publishes and fetches in flight at once.
MAX_PUBLISHING, MAX_FETCHING = 16, 64
CODEC_THREADS = 4
# Seconds the fetch latency histogram's buckets end at.
FETCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RemoteTier(Tier):
    name = "remote"

    def __init__(self, store, pool, loop: asyncio.AbstractEventLoop, secrets_of, prefix: str):
        self.store = store
        self.pool = pool
        self._loop = loop
        self._secrets_of = secrets_of
        self.prefix = prefix
        self.breaker = Breaker(f"the remote store {store.spec.describe()}")
        self._codec = concurrent.futures.ThreadPoolExecutor(
            CODEC_THREADS, thread_name_prefix="kvdepot-remote", initializer=name_os_thread
        )
        self._present: collections.OrderedDict = collections.OrderedDict()  # (digest, key) -> (lengths, until)
        self._absent: collections.OrderedDict = collections.OrderedDict()  # (digest, key) -> until
        self._finding: dict[tuple, asyncio.Future] = {}
        self._queue: PublishQueue | None = None  # made at attach: it asks the host for shares
        self._publishing = 0
        # Sealing buffers between publishes, at most one a publisher.
        self._buffers: list[bytearray] = []
        self._fetching: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._logged: set[str] = set()
        self.closing = False
        self.counts = collections.Counter()
        self.discarded: collections.Counter = collections.Counter()
        self.fetch_buckets = [0] * (len(FETCH_BUCKETS) + 1)
        self.fetch_seconds = 0.0

    def attach(self, host) -> None:
        super().attach(host)
        self._queue = PublishQueue(host.share)

    def recover(self) -> None:
        """At start: connect now, so that the first lookup does not pay for it."""
        self._spawn(self._connect())

    async def _connect(self) -> None:
        try:
            await self.store.ping()
        except Exception as e:  # noqa: BLE001 - a store that is away at start is retried later
            self._store_failed(e)
            log.warning("the remote store does not answer at start: %s; lookups retry", await self.store.diagnose(e))
            return
        self.breaker.succeeded()

    # ------------------------------------------------------------ keys and secrets

    def _secrets(self, ns) -> fmt.Secrets | None:
        return None if self.closing else self._secrets_of(ns.scope)

    def store_key(self, ns, key: bytes, rank: int) -> bytes:
        return fmt.store_key(f"{self.prefix}:{ns.scope}", ns.digest, key, rank)

    def _overhead(self, store_key: bytes) -> int:
        return fmt.HEADER.size + len(store_key) + fmt.MAC_BYTES

    # ------------------------------------------------------------ lookups

    def _known(self, ns, key: bytes) -> tuple | None:
        entry = self._present.get((ns.digest, key))
        if entry is None:
            return None
        if entry[1] < time.monotonic():
            del self._present[(ns.digest, key)]
            return None
        return entry[0]

    def _remember(self, index_key: tuple, lengths: tuple) -> None:
        self._absent.pop(index_key, None)
        self._present[index_key] = (lengths, time.monotonic() + PRESENT_TTL_S)
        self._present.move_to_end(index_key)
        while len(self._present) > MAX_KNOWN:
            self._present.popitem(last=False)

    def _forget(self, index_key: tuple, until: float) -> None:
        self._present.pop(index_key, None)
        self._absent[index_key] = until
        self._absent.move_to_end(index_key)
        while len(self._absent) > MAX_KNOWN:
            self._absent.popitem(last=False)

    def may_find(self, ns) -> bool:
        return self._secrets(ns) is not None

    async def find(self, ns, keys: list[bytes]) -> int:
        """Asks the store which of the leading run of `keys` it holds whole
        (every rank); returns how many leading keys it holds, as now known."""
        if self._secrets(ns) is None:
            return 0
        now = time.monotonic()
        asking, waiting = [], []
        for key in keys[:MAX_FIND_RUN]:
            index_key = (ns.digest, key)
            if self._known(ns, key) is not None:
                continue
            if self._absent.get(index_key, 0) > now:
                break
            pending = self._finding.get(index_key)
            if pending is not None:
                waiting.append(pending)
            else:
                asking.append(key)
        if not asking and keys and self.breaker.state != CLOSED:
            asking = [keys[0]]  # the store must answer a trial before blocks are fetched again
        if asking and self.breaker.allows():
            future = self._loop.create_future()
            mine = [k for k in asking if (ns.digest, k) not in self._finding]
            for key in mine:
                self._finding[(ns.digest, key)] = future
            try:
                await self._probe(ns, asking)
            finally:
                for key in mine:
                    if self._finding.get((ns.digest, key)) is future:
                        del self._finding[(ns.digest, key)]
                if not future.done():
                    future.set_result(None)
        if waiting:
            # Shielded: a Lookup cancelled while it waits (its client's deadline)
            # must not cancel the probe other Lookups wait for.
            await asyncio.gather(*(asyncio.shield(f) for f in set(waiting)))
        found = 0
        for key in keys:
            if self._known(ns, key) is None:
                break
            found += 1
        return found

    async def _probe(self, ns, keys: list[bytes]) -> None:
        """Asks in growing chunks (4, 16, 64...) and stops at the first block the
        store lacks: only the leading run counts, and most runs of a new prompt
        end at their first block."""
        start, chunk = 0, 4
        while start < len(keys):
            if not await self._probe_chunk(ns, keys[start : start + chunk]):
                return
            start, chunk = start + chunk, chunk * 4

    async def _probe_chunk(self, ns, keys: list[bytes]) -> bool:
        """Whether the store holds every rank of every one of `keys`."""
        ranks = range(ns.tp_size)
        store_keys = [self.store_key(ns, key, rank) for key in keys for rank in ranks]
        try:
            sizes = await self.store.lengths(store_keys)
        except Exception as e:  # noqa: BLE001 - a store that fails is a miss
            self._store_failed(e)
            return False
        self.breaker.succeeded()
        until = time.monotonic() + ABSENT_TTL_S
        whole = True
        for i, key in enumerate(keys):
            at = i * ns.tp_size
            try:
                lengths = [fmt.stored_payload(sizes[at + r], store_keys[at + r], ns.block_bytes,
                                              self.pool.largest_shard) for r in ranks]
            except fmt.Rejected as e:
                lengths = None
                self._rejected(e.cause)
                self._forget((ns.digest, key), time.monotonic() + REJECTED_TTL_S)
            if lengths and all(lengths):
                self._remember((ns.digest, key), tuple(lengths))
                continue
            if whole:
                self.counts["misses"] += 1  # the block that ends the run
            whole = False
            if lengths is not None:
                self._forget((ns.digest, key), until)
        return whole

    def holds(self, ns, key: bytes) -> bool:
        return self._secrets(ns) is not None and self._known(ns, key) is not None

    def promotable(self, ns, key: bytes) -> tuple | None:
        # Only while the store answers: a trial call is a probe or a publish.
        if self._secrets(ns) is None or self.breaker.state != CLOSED:
            return None
        lengths = self._known(ns, key)
        if lengths is None or not self._fetch_room(ns):
            return None
        return lengths

    def _fetch_room(self, ns) -> bool:
        """A scope fetches at most its share of MAX_FETCHING blocks at once
        among the scopes fetching, and at least one."""
        taking = self._fetching.get(ns.scope, 0)
        if not taking:
            return True  # another scope's fetches in flight never lock this one out
        active = len(set(self._fetching) | {ns.scope})
        return taking + 1 <= MAX_FETCHING * self.host.share(ns.scope, active)

    def promote(self, ns, key: bytes, slots: list[int], done) -> None:
        self._fetching[ns.scope] = self._fetching.get(ns.scope, 0) + 1
        self._spawn(self._fetch(ns, key, self._known(ns, key), slots, done))

    async def _fetch(self, ns, key: bytes, lengths: tuple | None, slots: list[int], done) -> None:
        started = time.monotonic()
        ok = False
        try:
            secrets = self._secrets(ns)
            if secrets is None or lengths is None:
                return
            store_keys = [self.store_key(ns, key, rank) for rank in range(ns.tp_size)]
            sizes = [self._overhead(k) + length for k, length in zip(store_keys, lengths)]
            try:
                values = await self.store.get(store_keys, sizes)
            except Exception as e:  # noqa: BLE001 - a store that fails is a miss
                self._store_failed(e)
                return
            self.breaker.succeeded()
            work = self._codec.submit(self._unseal, values, store_keys, secrets, lengths, slots)
            try:
                cause = await asyncio.wrap_future(work)
            except asyncio.CancelledError:
                # At shutdown: the slots are freed once the thread no longer writes them.
                concurrent.futures.wait([work])
                raise
            except Exception:  # noqa: BLE001 - a block that cannot be checked is a miss
                log.exception("checking a block from the remote store failed")
                return
            if cause is None:
                ok = True
                self.counts["promotions"] += 1
                self.counts["read_shards"] += ns.tp_size
                self.counts["read_bytes"] += sum(lengths)
                self._observe(time.monotonic() - started)
            else:
                self._rejected(cause)
                # Not fetched again soon: the bad value stays until the store evicts it.
                self._forget((ns.digest, key), time.monotonic() + REJECTED_TTL_S)
        finally:
            left = self._fetching.pop(ns.scope, 0) - 1
            if left > 0:
                self._fetching[ns.scope] = left
            if not ok:
                self.counts["failed_promotions"] += 1
            done(ok)

    def _unseal(self, values, store_keys, secrets, lengths, slots) -> str | None:
        """Checks every rank's value, then copies the payloads into the slots:
        a block with one bad rank writes no slot. The cause of a refusal, or None."""
        payloads = []
        for value, store_key, length in zip(values, store_keys, lengths):
            try:
                payload = fmt.decode(value, store_key, secrets, self.pool.largest_shard)
            except fmt.Rejected as e:
                return e.cause
            if len(payload) != length:
                return "bad_length"
            payloads.append(payload)
        for payload, slot in zip(payloads, slots):
            self.pool.slot_view(slot, len(payload))[:] = payload
        return None

    # ------------------------------------------------------------ publishing

    def demote(self, ns, rank: int, blocks, length: int) -> None:
        secrets = self._secrets(ns)
        if secrets is None:
            return
        skipping = self.breaker.skipping()
        for block in blocks:
            queued = False if skipping else self._queue.offer(ns.scope, (ns.digest, block.key, rank),
                                                               (block, rank, length, secrets))
            if queued is False:
                self.counts["dropped_writes"] += 1
        while self._publishing < MAX_PUBLISHING and self._queue.queued:
            self._publishing += 1
            self._spawn(self._publish_queued())

    async def _publish_queued(self) -> None:
        try:
            while not self.closing:
                item = self._queue.next()
                if item is None:
                    return
                try:
                    await self._publish(*item)
                except Exception:  # noqa: BLE001 - one shard's failure must not stop the publisher
                    self.counts["dropped_writes"] += 1
                    log.exception("publishing a shard to the remote store failed")
        finally:
            self._publishing -= 1

    async def _publish(self, block, rank: int, length: int, secrets) -> None:
        host, ns = self.host, block.ns
        shard = (ns.digest, block.key, rank)
        if not host.holds(block) or not self.breaker.allows():
            self._queue.unmark(shard)  # not sent: a later commit of it may be
            self.counts["not_published" if self.breaker.state == CLOSED else "dropped_writes"] += 1
            return
        store_key = self.store_key(ns, block.key, rank)
        buffer = self._buffer(fmt.sealed_size(store_key, length))
        # Pinned first, then checked: the native lane's thread may evict the
        # block between two calls, and a gone block's hold pins nothing, so
        # only a block still held after its hold is read (never a slot that
        # may hold another block by now).
        host.hold(block)
        try:
            slot = block.slots[rank]
            if not host.holds(block) or slot is None or rank not in block.committed:
                self._queue.unmark(shard)
                self.counts["not_published"] += 1
                self._buffers.append(buffer)
                return
            value = await self._loop.run_in_executor(self._codec, self._seal, buffer, store_key, slot, length, secrets)
        finally:
            host.let_go(block)
        try:
            stored = await self.store.put(store_key, value)
        except Exception as e:  # noqa: BLE001 - a store that fails drops the shard
            self._queue.unmark(shard)
            self.counts["dropped_writes"] += 1
            self._write_failed(e)
            return
        finally:
            value.release()
            self._buffers.append(buffer)  # the client has copied it: the next shard's
        self.breaker.succeeded()
        if stored:
            self.counts["written_shards"] += 1
            self.counts["written_bytes"] += length
        else:
            self.counts["already_stored"] += 1  # another node published it first

    def _buffer(self, size: int) -> bytearray:
        """A buffer of at least `size` bytes: one kept from an earlier publish
        when one is large enough (fresh 2 MiB allocations cost the kernel more
        to zero than the HMAC costs), else a new one."""
        for i, buffer in enumerate(self._buffers):
            if len(buffer) >= size:
                return self._buffers.pop(i)
        if len(self._buffers) >= MAX_PUBLISHING:
            self._buffers.pop(0)  # too small for today's shards
        return bytearray(size)

    def _seal(self, buffer: bytearray, store_key: bytes, slot: int, length: int, secrets) -> memoryview:
        return fmt.seal_into(buffer, store_key, self.pool.slot_view(slot, length), secrets)

    # ------------------------------------------------------------ failures and counters

    def _store_failed(self, error: BaseException) -> None:
        self.counts["store_errors"] += 1
        self.breaker.failed(error)

    def _write_failed(self, error: BaseException) -> None:
        """A write the server refused (out of memory under noeviction, an ACL
        without SET, a read-only replica) is a dropped shard, logged once: the
        store still answers, and its reads go on. A timeout or a lost
        connection counts against the store."""
        if self.store.refused(error):
            self.counts["store_errors"] += 1
            self._log_once(f"refused:{type(error).__name__}", "the remote store refused a write (%s): shards are "
                           "dropped while it does; reads go on", error)
            return
        self._store_failed(error)

    def _log_once(self, cause: str, message: str, *args) -> None:
        if cause not in self._logged:
            self._logged.add(cause)
            log.warning(message, *args)

    def _rejected(self, cause: str) -> None:
        self.discarded[cause] += 1
        self._log_once(cause, "a value read from the remote store failed its check (%s): served as a miss; "
                       "later ones of this cause are counted in the stats, not logged", cause)

    def _observe(self, seconds: float) -> None:
        self.fetch_seconds += seconds
        for i, bound in enumerate(FETCH_BUCKETS):
            if seconds <= bound:
                self.fetch_buckets[i] += 1
                return
        self.fetch_buckets[-1] += 1

    def _spawn(self, coroutine) -> None:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def clear(self, ns) -> None:
        """This daemon forgets what it knew of the store for `ns`; the store's
        values stay (other nodes share them) until its own eviction."""
        for known in (self._present, self._absent):
            for index_key in [k for k in known if ns is None or k[0] == ns.digest]:
                del known[index_key]
        self._queue.forget(None if ns is None else ns.digest)

    def stats(self) -> TierStats:
        c = self.counts
        return TierStats(
            name=self.name,
            shards=sum(len(lengths) for lengths, _ in self._present.values()),  # a rank's each, as other tiers
            written_shards=c["written_shards"], written_bytes=c["written_bytes"],
            read_shards=c["read_shards"], read_bytes=c["read_bytes"],
            promotions=c["promotions"], failed_promotions=c["failed_promotions"],
            write_errors=c["store_errors"],
            discarded=dict(self.discarded),
            misses=c["misses"], dropped_writes=c["dropped_writes"],
            circuit=self.breaker.state,
            fetch_bounds=FETCH_BUCKETS, fetch_counts=tuple(self.fetch_buckets), fetch_seconds=self.fetch_seconds,
        )

    async def close(self) -> None:
        self.closing = True
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=self.store.spec.timeout_s * 4)
        for task in tasks:
            task.cancel()
        await self.store.close()
        self._codec.shutdown(wait=True)
