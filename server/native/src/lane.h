// The native lane: the daemon's per-job path in compiled code.
//
// The Python lane (server/core: depot.py, index.py, eviction.py, shares.py;
// server/transports; server/api/job_socket.py) is the reference: every rule
// here is a port of a rule there, named after it, with the same errors. This
// header holds the data model the lane's parts share; each .cpp file is one
// part: index.cpp (the block index), eviction.cpp (LRU, ARC, shares),
// slots.cpp (the pool's runs of slots), jobs.cpp (sessions, workers, jobs),
// wire.cpp (the job socket's protobuf frames), conns.cpp (the job socket's
// connections), shm.cpp and cuda*.cpp (the transports' copies), seal.cpp
// (records of the kept pool), capi.cpp (the C functions Python calls).
//
// Threads: everything here is the event loop's thread's, called from Python
// through capi.cpp, except what the transports' and the sealer's own threads
// touch: their queues (under their mutexes) and the bytes of slots that jobs
// pin. They tell the loop through one eventfd, which the lane's epoll set
// watches; Python watches that epoll set with the event loop.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace kvd {

constexpr size_t KEY_BYTES = 32;
constexpr uint32_t NIL = UINT32_MAX;
// Ranks are bits of a mask; the daemon refuses the native lane when
// --max-tp-size allows more (server/native/depot.py).
constexpr uint32_t MAX_TP = 64;
// The writer of every rank of a block being promoted (index.py PROMOTION).
constexpr uint64_t PROMOTION = UINT64_MAX;
// Job ids a session finished recently, still refused as duplicates (sessions.py).
constexpr size_t RECENT_JOB_IDS = 4096;
// The largest frame either side accepts (kvdepot/defaults.py).
constexpr uint32_t MAX_JOB_FRAME_BYTES = 64u << 20;
constexpr size_t RECORD_BYTES = 128;

// gRPC status codes of refusals (kvdepot/errors.py).
enum Code : int {
  OK = 0,
  INVALID_ARGUMENT = 3,
  NOT_FOUND = 5,
  ALREADY_EXISTS = 6,
  RESOURCE_EXHAUSTED = 8,
  FAILED_PRECONDITION = 9,
  INTERNAL = 13,
  UNAVAILABLE = 14,
};

// A request the lane refuses: thrown by the checks, answered as the call's error.
struct Refusal {
  int code;
  std::string message;
};

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Names the calling thread in the kernel (top -H, /proc/PID/task/*/comm), as
// kvdepot/thread_names.py does for Python's threads.
void name_thread(const std::string& name);

// True on a lane's own thread. Per-thread state that only the lane's code
// changes there (CUDA's current device) may be cached for it; the daemon's
// Python threads, which also queue jobs, change such state themselves.
extern thread_local bool on_lane_thread;

struct Key {
  uint8_t b[KEY_BYTES];
};

struct IndexKey {
  uint32_t ns;
  Key key;
  bool operator==(const IndexKey& o) const { return ns == o.ns && std::memcmp(key.b, o.key.b, KEY_BYTES) == 0; }
};

// Keys are the clients' own bytes: hashed with a seed they cannot know, so
// that no client can make the index's buckets collide.
struct KeyHash {
  using is_avalanching = void;  // XXH3: the map needs no mixing of its own
  uint64_t seed = 0;
  size_t operator()(const IndexKey& k) const;
};

// A block's state as engines' copies of their namespace follow it (blocks.py
// BlockState), and what an event tells Python.
enum class Change : uint8_t {
  STORING = 1,
  READY = 2,
  DROPPED = 3,
  // A ready block evicted from DRAM: LOWER if a tier below holds it, else DROPPED
  // (Python asks the tiers).
  EVICTED = 4,
};

// What the daemon counts (counters.py Counters), in that order.
enum Count : int {
  LOOKUPS,
  HIT_BLOCKS,
  MISS_BLOCKS,
  STORED_BLOCKS,
  STORED_BYTES,
  LOADED_BLOCKS,
  LOADED_BYTES,
  EVICTED_BLOCKS,
  FAILED_JOBS,
  DISK_HIT_BLOCKS,
  N_COUNTS,
};

struct Counters {
  uint64_t v[N_COUNTS] = {};
  void add(int which, uint64_t delta) { v[which] = v[which] + delta < v[which] ? UINT64_MAX : v[which] + delta; }
};

enum class JobKind : uint8_t { STORE = 0, LOAD = 1 };

// ---------------------------------------------------------------- the index

struct Shard {
  int64_t slot = -1;
  uint64_t writer = 0;  // the job writing it, where the writers mask has the rank
  uint64_t length = 0;  // a kept block's bytes of the rank, where has_lengths
};

struct Block {
  IndexKey ik;
  uint32_t gen = 0;  // bumped when the entry is reused: handles name (index, gen)
  uint32_t scope = 0;
  uint32_t pins = 0;
  uint32_t loading = 0;
  uint64_t committed = 0;  // ranks committed
  uint64_t writers = 0;    // ranks being written
  uint16_t tp = 0;
  bool live = false;
  bool ready = false;
  bool promoted = false;
  bool has_lengths = false;
  bool pinned_listed = false;
  // Its place in its scope's eviction order: list 1 (LRU, or ARC's T1), 2 (T2).
  uint8_t list = 0;
  uint32_t prev = NIL, next = NIL;
  std::vector<Shard> shards;

  int held_slots() const {
    int n = 0;
    for (const Shard& s : shards) n += s.slot >= 0;
    return n;
  }
};

// An intrusive list of blocks, oldest first.
struct Order {
  uint32_t head = NIL, tail = NIL;
  size_t size = 0;
};

// Keys recently evicted (ARC's B1 and B2), oldest first.
struct Ghosts {
  std::list<IndexKey> order;
  std::unordered_map<IndexKey, std::list<IndexKey>::iterator, KeyHash> where;
  explicit Ghosts(KeyHash hash) : where(16, hash) {}
  bool has(const IndexKey& k) const { return where.count(k) != 0; }
  void add(const IndexKey& k);
  void erase(const IndexKey& k);
  void pop_oldest();
};

// One scope's eviction order (eviction.py LRUPolicy / ARCPolicy).
struct Policy {
  bool arc = false;
  double capacity = 1;
  double p = 0;
  Order t1, t2;
  Ghosts b1, b2;
  Policy(bool arc, double capacity, KeyHash hash) : arc(arc), capacity(capacity), b1(hash), b2(hash) {}
  size_t size() const { return t1.size + t2.size; }
};

struct Scope {
  std::string name;
  int64_t quota = -1;  // the most slots it may hold; -1: none
  int64_t held = 0;
  int64_t storing = 0;
  bool in_held = false;  // in the index's _held (order of first holding)
  std::unique_ptr<Policy> policy;
};

struct Namespace {
  uint32_t id = 0;
  uint32_t scope = 0;
  uint16_t tp = 1;
  bool live = false;
  // Some engine keeps a copy of its keys: its block changes go to Python.
  bool followed = false;
  std::string name;
  int64_t used_slots = 0;
  int64_t ready_blocks = 0;
  Counters counters;
  // What sealed records name it by (shard_record.py ns_digest, 16 bytes).
  std::string digest;
};

// ---------------------------------------------------------------- jobs

struct Session;
struct Worker;

struct Job {
  uint64_t id = 0;
  JobKind kind = JobKind::STORE;
  Session* session = nullptr;
  Worker* worker = nullptr;
  std::vector<uint32_t> blocks;  // index entries
  std::vector<uint32_t> block_ids;
  std::vector<int64_t> slots;
  int64_t submitted_ns = 0;
  // The CUDA transport's state: a store's compute event and fence number, its
  // entries of its stream's id ring, and the event its copies end with.
  void* event = nullptr;
  uint64_t fence_seq = 0;
  int64_t span_start = -1, span_end = -1;
  void* copy_event = nullptr;
  bool at_gate = false;
  // A store's keys left out (already stored) and not stored, for its JobDone.
  uint32_t already = 0, not_stored = 0;
  // A store's shard hashes, where its GPU computed them (hash_kernel.py), in block order.
  std::vector<uint64_t> hashes;
  // Stage stamps (jobtrace), when tracing.
  std::vector<std::pair<uint8_t, int64_t>> trace;
};

enum class TransportKind : uint8_t { SHM = 1, CUDA = 2 };

struct Worker {
  uint32_t id = 0;
  Session* session = nullptr;
  uint32_t ns = 0;
  uint32_t rank = 0;
  uint64_t num_blocks = 0;
  uint64_t block_bytes = 0;
  int32_t node = -1;
  TransportKind transport = TransportKind::SHM;
  uint32_t in_flight = 0;
  bool closing = false;
  // Shared memory: the staging rows the daemon mapped.
  uint8_t* staging = nullptr;
  uint64_t staging_bytes = 0;
  // CUDA: the device, the page table on it, the fence, opened compute events.
  int device_index = -1;
  uint64_t table[4] = {};
  uint64_t pages_per_block = 0;
  uint64_t max_page_bytes = 0;
  uint64_t fence_address = 0;
  std::unordered_map<std::string, void*> events;
};

struct Session {
  uint32_t handle = 0;
  uint32_t number = 0;
  std::string id;
  uint64_t max_jobs = 4096;
  bool ended = false;
  int32_t conn = -1;  // its job socket connection, if the lane holds one
  std::unordered_map<uint64_t, Job*> jobs;
  std::deque<uint64_t> recent;
  std::unordered_set<uint64_t> recent_set;
  Counters counters;
  std::unordered_map<uint32_t, Worker*> workers;
};

// A job whose copies ended, on its way to the loop.
struct Ended {
  Job* job;
  bool ok;
  std::string error;
};

}  // namespace kvd
