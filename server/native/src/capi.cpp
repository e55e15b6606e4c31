// The C functions Python calls (server/native/binding.py declares each): the
// lane's life, scopes, sessions, CUDA devices and jobs here; the index's and
// the counts' in capi_index.cpp.
// Every one that takes a lane runs on the event loop's thread; the hashes
// (kvd_*hash*), which take none, run on adoption's threads. A call that can
// refuse returns a gRPC status code (0: none) and leaves its message for
// kvd_error. A closed lane (NULL: the daemon is exiting, and a call may still
// come from a stream that ends late) is a call that does nothing.
#include "capi.h"

using namespace kvd;
using namespace kvd::capi;

extern "C" {

// host/shard_hash.py's hash on the CPU (checking records the GPU sealed, at adoption); no lane needed.
KVD_API uint64_t kvd_gpu_hash(const uint8_t* data, size_t length) { return kvd::gpu_hash(data, length); }

// The same of `n` shards at once, in one call: adoption's threads hash a part of the kept blocks
// each, and a Python call a shard made them queue for the GIL between shards.
KVD_API void kvd_gpu_hash_many(const uint64_t* addresses, const uint64_t* lengths, uint64_t* hashes, size_t n) {
  for (size_t i = 0; i < n; i++)
    hashes[i] = kvd::gpu_hash(reinterpret_cast<const uint8_t*>(addresses[i]), lengths[i]);
}

// xxh3 (data_hash) of `length` bytes at each of `n` offsets of `base`: adoption checks every kept
// record's own hash, hundreds of thousands of them at a start.
KVD_API void kvd_data_hash_many(const uint8_t* base, const uint64_t* offsets, uint64_t length, uint64_t* hashes,
                                size_t n) {
  for (size_t i = 0; i < n; i++) hashes[i] = kvd::data_hash(base + offsets[i], length);
}

// xxh3 (data_hash) of each of `n` shards at once, from and into uint64 arrays: adoption's
// threads check the kept blocks' bytes a part each, and a Python call a shard made them queue
// for the GIL between shards (a start's checks were bound by it, not by the hashing).
KVD_API void kvd_data_hash_at(const uint64_t* addresses, const uint64_t* lengths, uint64_t* hashes, size_t n) {
  for (size_t i = 0; i < n; i++)
    hashes[i] = kvd::data_hash(reinterpret_cast<const uint8_t*>(addresses[i]), lengths[i]);
}

// A source digest compiled in, so that Python can tell a stale build (build.py).
KVD_API const char* kvd_build_id() { return KVD_BUILD_ID; }

KVD_API Lane* kvd_open(const LaneConfig* config, char* error, size_t error_bytes) {
  try {
    Lane* lane = new Lane(*config);
    lane->start();
    return lane;
  } catch (std::exception& e) {
    snprintf(error, error_bytes, "%s", e.what());
    return nullptr;
  }
}

KVD_API void kvd_close(Lane* lane) {
  if (!lane) return;
  lane->stop();
  // Copies still running (the daemon gave up draining) may touch the lane's
  // memory until the process exits: it is left to the exit.
  if (lane->jobs->in_flight) return;
  delete lane;
}

KVD_API const char* kvd_error(Lane* lane) {
  if (!lane) return "";
  std::lock_guard<std::mutex> lock(lane->mutex);
  return lane->error.c_str();
}

KVD_API int kvd_events_fd(Lane* lane) {
  if (!lane) return -1;
  return lane->python_fd;
}

// What the lane said since the last call; valid until the next call.
KVD_API size_t kvd_take_events(Lane* lane, const uint8_t** data) {
  if (!lane) return 0;
  std::lock_guard<std::mutex> lock(lane->mutex);
  const std::string& taken = lane->take_events();
  *data = reinterpret_cast<const uint8_t*>(taken.data());
  return taken.size();
}

// ---------------------------------------------------------------- scopes and namespaces

KVD_API uint32_t kvd_scope(Lane* lane, const char* name, int64_t quota) {
  if (!lane) return 0;
  std::lock_guard<std::mutex> lock(lane->mutex);
  return lane->index->scope(name, quota);
}

KVD_API void kvd_ns_add(Lane* lane, uint32_t id, uint32_t scope, uint32_t tp, const char* name, const uint8_t* digest) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Namespace& ns = lane->index->add_namespace(id, scope, (uint16_t)tp, name);
  ns.digest.assign(reinterpret_cast<const char*>(digest), 16);
}

KVD_API void kvd_ns_follow(Lane* lane, uint32_t id, int followed) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Namespace* ns = lane->index->ns(id);
  if (ns) ns->followed = followed != 0;
}

KVD_API void kvd_ns_remove(Lane* lane, uint32_t id) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  lane->index->remove_namespace(id);
}

KVD_API int kvd_ns_counts(Lane* lane, uint32_t id, int64_t* counts, uint64_t* counters) {
  if (!lane) return UNAVAILABLE;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Namespace* ns = lane->index->ns(id);
  if (!ns) return NOT_FOUND;
  counts[0] = ns->used_slots;
  counts[1] = ns->ready_blocks;
  put_counters(ns->counters, counters);
  return 0;
}

KVD_API void kvd_ns_count(Lane* lane, uint32_t id, uint32_t session, int which, uint64_t delta) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Namespace* ns = lane->index->ns(id);
  if (ns) lane->jobs->count(lane->jobs->session(session), *ns, which, delta);
}

// ---------------------------------------------------------------- sessions and workers

KVD_API void kvd_session_add(Lane* lane, uint32_t handle, uint32_t number, const char* id, uint64_t max_jobs) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  lane->jobs->add_session(handle, number, id, max_jobs);
}

KVD_API void kvd_session_end(Lane* lane, uint32_t handle) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Session* s = lane->jobs->session(handle);
  if (s && s->conn >= 0) lane->conns->close((uint32_t)s->conn);
  lane->jobs->end_session(handle);
}

KVD_API int kvd_session_info(Lane* lane, uint32_t handle, uint64_t* counts, uint64_t* counters) {
  if (!lane) return UNAVAILABLE;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Session* s = lane->jobs->session(handle);
  if (!s) return NOT_FOUND;
  counts[0] = s->jobs.size();
  counts[1] = s->workers.size();
  put_counters(s->counters, counters);
  return 0;
}

KVD_API int kvd_worker_add(Lane* lane, uint32_t session, uint32_t worker, uint32_t ns, uint32_t rank, uint64_t num_blocks,
                   uint64_t block_bytes, int32_t node, int transport, uint64_t staging, uint64_t staging_bytes) {
  if (!lane) return UNAVAILABLE;
  std::lock_guard<std::mutex> lock(lane->mutex);
  return guarded(lane, [&] {
    Session* s = lane->jobs->session(session);
    Namespace* n = lane->index->ns(ns);
    if (!s || !n || rank >= n->tp) throw Refusal{FAILED_PRECONDITION, "the lane knows no such session or namespace"};
    if (transport != (int)TransportKind::SHM && transport != (int)TransportKind::CUDA)
      throw Refusal{INVALID_ARGUMENT, "no such transport in the lane"};
    if (transport == (int)TransportKind::CUDA && !lane->cuda)
      throw Refusal{FAILED_PRECONDITION, "the lane's CUDA transport is not set up"};
    if (transport == (int)TransportKind::SHM && staging_bytes / std::max<uint64_t>(1, block_bytes) < num_blocks)
      throw Refusal{INVALID_ARGUMENT, "the staging memory does not hold the worker's blocks"};
    Worker& w = lane->jobs->add_worker(*s, worker, *n, rank, num_blocks, block_bytes, node, (TransportKind)transport);
    w.staging = reinterpret_cast<uint8_t*>(staging);
    w.staging_bytes = staging_bytes;
  });
}

// ---------------------------------------------------------------- CUDA

// The CUDA transport, once Python has set up CUDA (the entry points torch loaded).
KVD_API void kvd_cuda_init(Lane* lane, const CudaApi* api) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  if (lane->cuda) return;
  lane->cuda.reset(new CudaTransport(*api, reinterpret_cast<uint8_t*>(lane->config.pool_base), lane->config.slot_bytes,
                                     *lane->completions));
  lane->jobs->transports[(int)TransportKind::CUDA] = lane->cuda.get();
}

KVD_API int kvd_cuda_has_device(Lane* lane, int index) {
  if (!lane) return 0;
  std::lock_guard<std::mutex> lock(lane->mutex);
  return lane->cuda && lane->cuda->has_device(index);
}

KVD_API void kvd_cuda_device(Lane* lane, const CudaDeviceConfig* config) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  if (lane->cuda && !lane->cuda->has_device(config->index)) lane->cuda->add_device(*config);
}

KVD_API int kvd_cuda_worker(Lane* lane, uint32_t session, uint32_t worker, int device, const uint64_t* table,
                            uint64_t pages_per_block, uint64_t max_page_bytes, uint64_t fence) {
  if (!lane) return UNAVAILABLE;
  std::lock_guard<std::mutex> lock(lane->mutex);
  return guarded(lane, [&] {
    Session* s = lane->jobs->session(session);
    Worker* w = s ? lane->jobs->worker(*s, worker) : nullptr;
    if (!w || !lane->cuda || !lane->cuda->has_device(device))
      throw Refusal{FAILED_PRECONDITION, "the lane knows no such worker or GPU"};
    lane->cuda->open_worker(*w, device, table, pages_per_block, max_page_bytes, fence);
  });
}

// ---------------------------------------------------------------- connections and jobs

KVD_API int64_t kvd_conn_add(Lane* lane, uint32_t session, int fd, const char* peer, uint32_t uid, const uint8_t* first,
                             size_t first_bytes, const uint8_t* leftover, size_t leftover_bytes, int quiet) {
  if (!lane) return -1;
  std::lock_guard<std::mutex> lock(lane->mutex);
  Session* s = lane->jobs->session(session);
  if (!s) return -1;
  uint32_t id = lane->conns->add(*s, fd, peer, uid, std::string(reinterpret_cast<const char*>(first), first_bytes),
                                 std::string(reinterpret_cast<const char*>(leftover), leftover_bytes), quiet != 0);
  lane->conns->flush();
  lane->arm();  // the frames that came with the hello may have held a store at the gate
  return id;
}

KVD_API int kvd_submit(Lane* lane, uint32_t session, int kind, uint32_t worker, uint64_t job, const uint8_t* keys,
               const uint64_t* key_lengths, uint32_t n_keys, const uint32_t* block_ids, uint32_t n_ids,
               const uint8_t* event, size_t event_bytes, uint64_t fence_seq, uint32_t* answer) {
  if (!lane) return UNAVAILABLE;
  std::lock_guard<std::mutex> lock(lane->mutex);
  return guarded(lane, [&] {
    Session* s = lane->jobs->session(session);
    if (!s) throw Refusal{NOT_FOUND, "unknown session: attach first (after a daemon restart, attach and register again)"};
    JobRequest r;
    r.kind = kind ? JobKind::LOAD : JobKind::STORE;
    r.worker = worker;
    r.job = job;
    for (uint32_t i = 0, at = 0; i < n_keys; at += (uint32_t)key_lengths[i], i++) r.keys.push_back({keys + at, key_lengths[i]});
    r.block_ids.assign(block_ids, block_ids + n_ids);
    r.event = event;
    r.event_len = event_bytes;
    r.fence_seq = fence_seq;
    Submitted sub = lane->jobs->submit(*s, r, 0);
    lane->arm();  // a store held at the gate is asked when due
    answer[0] = sub.already;
    answer[1] = sub.not_stored;
  });
}

KVD_API void kvd_set_demote(Lane* lane, int on) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  lane->demote_events = on != 0;
}

KVD_API void kvd_set_draining(Lane* lane, int draining) {
  if (!lane) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  lane->jobs->draining = draining != 0;
}

}  // extern "C"
