// The C functions Python calls about the index (lookups, the tiers' moves) and
// the counts, and the wire codec's for the tests; capi.cpp says how they are
// called.
#include "capi.h"

using namespace kvd;
using namespace kvd::capi;

extern "C" {

// ---------------------------------------------------------------- the index, for lookups and the tiers

KVD_API int kvd_lookup(Lane* lane, uint32_t ns, const uint8_t* keys, uint32_t n, uint32_t start, int count_ready,
               uint32_t* out) {
  if (!lane) return UNAVAILABLE;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Namespace* space = lane->index->ns(ns);
  if (!space) return -1;
  std::vector<Key> k = keys_of(keys, n);
  size_t at = 0;
  out[0] = out[1] = out[2] = out[3] = 0;
  Index::Next next = lane->index->lookup(*space, k.data(), n, start, count_ready != 0, &out[0], &out[1], &out[2], &at);
  out[3] = (uint32_t)at;
  return (int)next;
}

KVD_API int kvd_contains(Lane* lane, uint32_t ns, const uint8_t* key) {
  if (!lane) return UNAVAILABLE;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Key k;
  std::memcpy(k.b, key, KEY_BYTES);
  return lane->index->contains(ns, k);
}

KVD_API size_t kvd_keys_of(Lane* lane, uint32_t ns, int which, const uint8_t** out) {
  if (!lane) return 0;
  std::lock_guard<std::mutex> lock(lane->mutex);
  std::vector<Key> keys = lane->index->keys_of(ns, (Index::Which)which);
  lane->scratch.assign(reinterpret_cast<const char*>(keys.data()), keys.size() * KEY_BYTES);
  *out = reinterpret_cast<const uint8_t*>(lane->scratch.data());
  return keys.size();
}

KVD_API void kvd_clear(Lane* lane, int64_t ns, uint64_t* out) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  const Namespace* space = ns < 0 ? nullptr : lane->index->ns((uint32_t)ns);
  if (ns >= 0 && !space) {
    out[0] = out[1] = 0;
    return;
  }
  auto counts = lane->index->clear(space);
  out[0] = counts.first;
  out[1] = counts.second;
}

// One kept block back in the index, under the lane's lock. `waited`: its
// slots were held for adoption (Slots::kept_waiting), counted out in the same
// locked step.
static bool restore_one(Lane* lane, Namespace* space, const uint8_t* key, const int64_t* slots,
                        const uint64_t* lengths, uint32_t tp, bool waited) {
  Slots& pool = *lane->slots;
  if (waited) pool.no_longer_waiting(run_slots(pool, slots, tp));
  bool placed = true;  // adoption placed each rank's run (free_runs.py fits)
  for (uint32_t i = 0; i < tp; i++) placed &= pool.in_use(slots[i]);
  if (!space || space->tp != tp || !placed) {
    for (uint32_t i = 0; i < tp; i++)
      if (pool.in_use(slots[i])) pool.release(slots[i]);
    return false;
  }
  Key k;
  std::memcpy(k.b, key, KEY_BYTES);
  // Held for adoption until now: stored before every block stored since the restart.
  return lane->index->restore(*space, k, std::vector<int64_t>(slots, slots + tp),
                              std::vector<uint64_t>(lengths, lengths + tp), waited);
}

// `count` kept blocks of namespace `ns`, in order, each of `tp` ranks: keys
// (count * KEY_BYTES), slots and lengths (count * tp, block by block). One call
// and one lock for a chunk's blocks, not one a block. `restored[i]`: whether
// block i went in (not when the index holds its key already: its slots are
// freed); returns how many did.
KVD_API uint64_t kvd_restore_many(Lane* lane, uint32_t ns, uint64_t count, uint32_t tp, const uint8_t* keys,
                                  const int64_t* slots, const uint64_t* lengths, int waited, uint8_t* restored) {
  if (!lane) return 0;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Namespace* space = lane->index->ns(ns);
  uint64_t done = 0;
  for (uint64_t i = 0; i < count; i++) {
    restored[i] = restore_one(lane, space, keys + i * KEY_BYTES, slots + i * tp, lengths + i * tp, tp, waited != 0);
    done += restored[i];
  }
  return done;
}

KVD_API void kvd_release_slots(Lane* lane, const int64_t* slots, size_t n, int waited) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Slots& pool = *lane->slots;
  if (waited) pool.no_longer_waiting(run_slots(pool, slots, n));
  for (size_t i = 0; i < n; i++)
    if (pool.in_use(slots[i])) pool.release(slots[i]);
}

// `used`: runs, their first slots and spans (free_runs.py fits() accepted them).
KVD_API void kvd_keep_only(Lane* lane, const int64_t* firsts, const int64_t* spans, size_t n, int64_t kept_waiting) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  lane->slots->keep_only(runs_of(firsts, spans, n));
  lane->slots->set_kept_waiting(kept_waiting);
}

KVD_API int64_t kvd_span_at(Lane* lane, int64_t slot) {
  if (!lane) return 0;
  std::lock_guard<std::mutex> lock(lane->mutex);
  return lane->slots->span_at(slot);
}

KVD_API uint64_t kvd_reserve_promotion(Lane* lane, uint32_t ns, const uint8_t* key, const uint64_t* lengths, int64_t* slots) {
  if (!lane) return 0;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Namespace* space = lane->index->ns(ns);
  if (!space) return 0;
  Key k;
  std::memcpy(k.b, key, KEY_BYTES);
  uint32_t b = lane->index->reserve_promotion(*space, k, std::vector<uint64_t>(lengths, lengths + space->tp));
  if (b == NIL) return 0;
  for (uint32_t rank = 0; rank < space->tp; rank++) slots[rank] = lane->index->block(b).shards[rank].slot;
  return lane->index->handle(b);
}

KVD_API void kvd_finish_promotion(Lane* lane, uint64_t handle, int ok) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Block* block = lane->index->by_handle(handle);
  if (!block) return;
  uint32_t b = (uint32_t)handle;
  Namespace& ns = *lane->index->ns(block->ik.ns);
  bool sealed = ok != 0;
  lane->index->finish_promotion(b, ok != 0);
  if (sealed && lane->index->by_handle(handle)) {
    // In DRAM again: the kept pool seals every rank (tiers.py TierStack._promoted).
    for (uint32_t rank = 0; rank < ns.tp; rank++)
      lane->sealer->seal(*lane->index, ns, rank, {b}, lane->index->block(b).shards[rank].length);
  }
}

// Whether the handle's block is still the index's (not evicted or cleared).
KVD_API int kvd_holds(Lane* lane, uint64_t handle) {
  if (!lane) return UNAVAILABLE;
  std::lock_guard<std::mutex> lock(lane->mutex);
  return lane->index->by_handle(handle) != nullptr;
}

KVD_API void kvd_hold(Lane* lane, uint64_t handle) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  if (lane->index->by_handle(handle)) lane->index->hold((uint32_t)handle);
}

KVD_API void kvd_let_go(Lane* lane, uint64_t handle) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  if (lane->index->by_handle(handle)) lane->index->let_go((uint32_t)handle);
}

// A block's rank: [slot, committed (0/1), namespace id, tp]; its key in `key`. 0: no such block.
KVD_API int kvd_block_info(Lane* lane, uint64_t handle, uint32_t rank, int64_t* out, uint8_t* key) {
  if (!lane) return UNAVAILABLE;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Block* block = lane->index->by_handle(handle);
  if (!block || rank >= block->tp) return 0;
  out[0] = block->shards[rank].slot;
  out[1] = (block->committed >> rank) & 1;
  out[2] = block->ik.ns;
  out[3] = block->tp;
  std::memcpy(key, block->ik.key.b, KEY_BYTES);
  return 1;
}

// ---------------------------------------------------------------- counts

// [used slots, pinned slots, eviction order size, jobs in flight, sessions ended,
//  sealed, not sealed, unsealed, store busy ns, load busy ns, connections, free slots,
//  free extents' slots]
KVD_API void kvd_counts(Lane* lane, int64_t* out) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  int64_t now = now_ns();
  out[0] = lane->slots->num_slots() - lane->slots->free();
  out[1] = lane->index->pinned_slots();
  out[2] = (int64_t)lane->index->eviction_size();
  out[3] = (int64_t)lane->jobs->in_flight;
  out[4] = (int64_t)lane->jobs->sessions_ended;
  out[5] = (int64_t)lane->sealer->sealed;
  out[6] = (int64_t)lane->sealer->skipped;
  out[7] = (int64_t)lane->sealer->unsealed();
  out[8] = lane->jobs->store_clock.seconds_ns(now);
  out[9] = lane->jobs->load_clock.seconds_ns(now);
  out[10] = (int64_t)lane->conns->size();
  out[11] = lane->slots->free();
  out[12] = lane->slots->free_extent_slots();
}

KVD_API void kvd_set_online(Lane* lane, const int64_t* firsts, const int64_t* counts, size_t n) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (size_t i = 0; i < n; i++) ranges.emplace_back(firsts[i], counts[i]);
  lane->slots->set_online(ranges);
}

// `held`: the runs (first slots, spans) of kept blocks waiting for other chunks.
KVD_API int64_t kvd_add_online(Lane* lane, int64_t first, int64_t count, const int64_t* held, const int64_t* spans,
                               size_t n_held) {
  if (!lane) return 0;
  std::lock_guard<std::mutex> lock(lane->mutex);
  return lane->slots->add_online(first, count, runs_of(held, spans, n_held));
}

KVD_API int64_t kvd_online_in(Lane* lane, uint32_t range) {
  if (!lane) return -1;
  std::lock_guard<std::mutex> lock(lane->mutex);
  if (range >= lane->slots->ranges().size()) return -1;
  return lane->slots->online_in(range);
}

KVD_API int64_t kvd_free_in(Lane* lane, uint32_t range) {
  if (!lane) return -1;
  std::lock_guard<std::mutex> lock(lane->mutex);
  return lane->slots->free_in(range);
}

KVD_API void kvd_totals(Lane* lane, uint64_t* out) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  put_counters(lane->jobs->totals, out);
}

KVD_API void kvd_job_times(Lane* lane, uint64_t* buckets, double* seconds, uint64_t* failures) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  std::memcpy(buckets, lane->jobs->job_times.buckets, sizeof lane->jobs->job_times.buckets);
  std::memcpy(seconds, lane->jobs->job_times.seconds, sizeof lane->jobs->job_times.seconds);
  std::memcpy(failures, lane->jobs->job_times.failures, sizeof lane->jobs->job_times.failures);
}

// For the tests' launchers alone (tests/daemon_with_held_copies.py): shared-memory copies wait at `gate`.
KVD_API void kvd_test_hold_copies(Lane* lane, const char* gate) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  lane->shm->hold_with(gate, 64);
}

KVD_API void kvd_set_generation(Lane* lane, uint64_t generation) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  lane->sealer->generation = generation;
}

KVD_API const char* kvd_verify(Lane* lane) {
  if (!lane) return "";
  std::lock_guard<std::mutex> lock(lane->mutex);
  lane->scratch = lane->index->verify();
  return lane->scratch.c_str();
}

}  // extern "C"

// For the tests of the wire codec (tests/test_native_wire.py): a frame's
// decoding as one line, "-" when it is not a JobFrame:
// KIND REQUEST_ID WORKER JOB FENCE_SEQ EVENT_HEX SESSION_HEX KEY_HEX,... ID,...
extern "C" KVD_API const char* kvd_decode_frame(const uint8_t* data, size_t size) {
  static thread_local std::string line;
  auto hex = [](const uint8_t* p, size_t n) {
    static const char* digits = "0123456789abcdef";
    std::string s;
    for (size_t i = 0; i < n; i++) s += digits[p[i] >> 4], s += digits[p[i] & 15];
    return s.empty() ? std::string("_") : s;
  };
  Frame f;
  if (!decode_frame(data, size, f)) return "-";
  const JobRequest& r = f.request;
  line = format("%d %llu %u %llu %llu ", (int)f.kind, (unsigned long long)f.request_id, r.worker,
                (unsigned long long)r.job, (unsigned long long)r.fence_seq);
  line += hex(r.event, r.event_len) + " " + hex(reinterpret_cast<const uint8_t*>(f.session_id.data()), f.session_id.size()) + " ";
  std::string keys, ids;
  for (auto& k : r.keys) keys += (keys.empty() ? "" : ",") + hex(k.first, k.second);
  for (uint32_t id : r.block_ids) ids += (ids.empty() ? "" : ",") + std::to_string(id);
  line += (keys.empty() ? "_" : keys) + " " + (ids.empty() ? "_" : ids);
  return line.c_str();
}
