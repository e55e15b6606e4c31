// Sessions, workers and jobs: a job's checks, its reservation in the index,
// its start on its transport and its end (port of server/core/depot.py's
// jobs, sessions.py, counters.py), and what the lane tells Python.
#pragma once

#include "index.h"

namespace kvd {

// What the lane tells Python, as records in one buffer Python reads after each
// call (server/native/events.py decodes them): [type u8][length u32][payload].
class Events {
 public:
  enum Type : uint8_t {
    CHANGE = 1,       // ns u32, state u8, key[32]
    JOB_DONE = 2,     // session u32, job u64, ok u8, already u32, not_stored u32, error...
    LOG = 3,          // level u8, key length u8, key (rate-limits a warning a client can repeat), text...
    RELEASED = 4,     // worker u32: no copy touches it any more
    CONN_CLOSED = 5,  // conn u32, session u32, kind u8
    COMMITTED = 6,    // ns u32, rank u32, length u64, then (handle u64, key[32])...
    TRACE = 7,        // session u32, job u64, kind u8, blocks u32, then (stage u8, ns i64)...
  };
  void change(uint32_t ns, const Key& key, Change state);
  void job_done(uint32_t session, uint64_t job, bool ok, uint32_t already, uint32_t not_stored,
                const std::string& error);
  void log(int level, const std::string& text, const std::string& key = "");
  void released(uint32_t worker);
  void conn_closed(uint32_t conn, uint32_t session, uint8_t kind);
  void committed(uint32_t ns, uint32_t rank, uint64_t length, const std::vector<uint64_t>& handles,
                 const std::vector<Key>& keys);
  void trace(uint32_t session, uint64_t job, JobKind kind, uint32_t blocks,
             const std::vector<std::pair<uint8_t, int64_t>>& stamps);
  bool empty() const { return buffer_.empty(); }
  std::string& buffer() { return buffer_; }

 private:
  void begin(Type type, size_t length);
  template <class T>
  void put(T value) {
    buffer_.append(reinterpret_cast<const char*>(&value), sizeof value);
  }
  std::string buffer_;
};

enum LogLevel : int { INFO = 20, WARNING = 30, ERROR = 40 };

// A job request as the wire gives it: keys as the client sent them (their
// lengths are checked here, with the core's errors).
struct JobRequest {
  JobKind kind = JobKind::STORE;
  uint32_t worker = 0;
  uint64_t job = 0;
  std::vector<std::pair<const uint8_t*, size_t>> keys;
  std::vector<uint32_t> block_ids;
  const uint8_t* event = nullptr;
  size_t event_len = 0;
  uint64_t fence_seq = 0;
};

struct Submitted {
  uint32_t already = 0;
  uint32_t not_stored = 0;
};

// Who moves a job's bytes (core/transport.py Transport, for the lane).
class Transport {
 public:
  virtual ~Transport() = default;
  // Refuses a request this transport cannot run (throws Refusal).
  virtual void prepare(Worker& worker, Job& job, const JobRequest& request) {}
  // Starts the job's copies; their end comes back through the lane's completions.
  virtual void start(Job& job) = 0;
  // The session ended: copies not started yet are dropped (ended as failed).
  virtual void abandon(Job& job) {}
  // The worker's last copy ended and it is closing: forget it.
  virtual void forget(Worker& worker) {}
  // On the lane's thread, each round and when due() comes: work the transport's
  // own threads handed back, or its own work due (the CUDA gate's asks).
  virtual void poll() {}
  // When poll() next has work that no other thread will wake the lane for
  // (now_ns()'s clock; INT64_MAX: none): the lane's timer wakes it then.
  virtual int64_t due() const { return INT64_MAX; }
  // A job of this transport ended (before its client is told).
  virtual void ended(Job& job) {}
};

// Where transports hand ended jobs (from any thread).
class Completions {
 public:
  explicit Completions(int eventfd) : eventfd_(eventfd) {}
  void push(std::vector<Ended>&& ended);
  void push(Ended&& ended);
  std::vector<Ended> take();
  // From a thread that holds none of the lane's locks and has nothing else
  // to do (a CUDA stream's, which only waits for its copies): while the loop
  // sleeps and the lane's lock is free, what has ended is finished on this
  // thread, which saves the loop's wake-up (tens of microseconds a job
  // alone); else it is handed to the loop as push does. The shared-memory
  // transport's threads push: their time is the copies'. Says whether this
  // thread finished them.
  bool deliver(std::vector<Ended>&& ended);
  // Wakes the loop for another part's work (the sealer's records).
  void poke();
  // Set by the lane before any copy thread starts: finishes what was pushed
  // if the lane's lock can be had at once, and says whether it did.
  std::function<bool()> finish_here;

 private:
  void wake();
  std::mutex mutex_;
  std::vector<Ended> ended_;
  bool woken_ = false;
  int eventfd_;
};

// Where a JobDone goes: the session's job socket connection, when the lane holds one.
class Replies {
 public:
  virtual ~Replies() = default;
  virtual bool job_done(Session& session, uint64_t job, bool ok, const std::string& error, const Submitted& counts) = 0;
  virtual void flush() = 0;
};

struct Clock {
  int64_t in_flight = 0;
  int64_t since_ns = 0;
  int64_t total_ns = 0;
  void start(int64_t now);
  void stop(int64_t now);
  int64_t seconds_ns(int64_t now) const { return in_flight ? total_ns + now - since_ns : total_ns; }
};

// Durations of finished jobs (counters.py JobTimes).
struct JobTimes {
  static constexpr int BUCKETS = 17;
  uint64_t buckets[2][BUCKETS] = {};
  double seconds[2] = {};
  uint64_t failures[2][2] = {};  // [kind][client_gone, transport]
  void finished(JobKind kind, bool ok, double elapsed, bool client_gone);
};

int64_t now_ns();

class Jobs {
 public:
  Jobs(Index& index, Slots& slots, Events& events, Completions& completions, Replies& replies);
  ~Jobs();

  Session& add_session(uint32_t handle, uint32_t number, const std::string& id, uint64_t max_jobs);
  Session* session(uint32_t handle);
  // The client is gone: its jobs end (failed), its workers close once their copies have.
  void end_session(uint32_t handle);
  Worker& add_worker(Session& session, uint32_t id, Namespace& ns, uint32_t rank, uint64_t num_blocks,
                     uint64_t block_bytes, int32_t node, TransportKind transport);
  Worker* worker(Session& session, uint32_t id);

  Submitted submit(Session& session, JobRequest& request, int64_t received_ns);
  // Jobs whose copies ended: every client told first, then the bookkeeping.
  void finish(std::vector<Ended>& ended);
  // A worker's transport says its last copy ended.
  void copies_ended(Worker& worker);
  // The lane's transports, for their rounds.
  std::vector<Transport*> all_transports() const;

  void count(Session* session, Namespace& ns, int which, uint64_t delta);

  Transport* transports[3] = {};  // by TransportKind
  bool draining = false;
  bool tracing = false;
  uint64_t in_flight = 0;
  uint64_t sessions_ended = 0;
  Counters totals;
  Clock store_clock, load_clock;
  JobTimes job_times;

 private:
  bool tell(Ended& ended);
  void settle(Ended& ended);
  void begin(Job* job);
  void forget_session(Session* session);
  void forget_if_done(Session* session);

  Index& index_;
  Slots& slots_;
  Events& events_;
  Completions& completions_;
  Replies& replies_;
  std::unordered_map<uint32_t, Session*> sessions_;
  // Ended sessions whose jobs still run: freed once the last has ended.
  std::unordered_set<Session*> dying_;
};

}  // namespace kvd
