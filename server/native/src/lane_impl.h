// The lane: its parts put together, and its thread, which serves the job
// connections and the copies' ends. Python's calls take the lane's lock, as
// the lane's thread does for each round of what is ready.
#pragma once

#include <sys/epoll.h>

#include "conns.h"
#include "cuda.h"
#include "seal.h"
#include "transports.h"

namespace kvd {

struct Range {
  int32_t node;
  int64_t first;
  int64_t count;
};

// What Python opens a lane with (server/native/binding.py LaneConfig).
struct LaneConfig {
  uint64_t pool_base;
  uint64_t slot_bytes;
  int64_t num_slots;
  uint64_t records_base;
  uint32_t arc;
  uint32_t tracing;
  // Every derived count recomputed after each round (KVDEPOT_CHECK_INDEX).
  uint32_t check;
  uint32_t n_ranges;
  const Range* ranges;
  uint64_t seed;
  uint64_t max_unread;
  // How the pool is cut into extents of runs (host/free_runs.py).
  int64_t chunk_slots;
  int64_t extent_slots;
  // Bytes of job socket frames not yet whole that one uid's connections may hold.
  uint64_t max_frame_bytes_per_uid;
};

class Lane : public IndexHooks, public Replies {
 public:
  explicit Lane(const LaneConfig& config);
  ~Lane() override;
  void start();
  void stop();
  // Python's side of the events: what the lane said since it last asked.
  const std::string& take_events();
  // Sets the timer for the transports' next work due (the lane's lock held):
  // after each round, and after a call that may have started a job.
  void arm();

  std::mutex mutex;

  void changed(const Namespace& ns, const Key& key, Change state) override;
  void evicted(Namespace& ns) override;
  void committed(Namespace& ns, uint32_t rank, const std::vector<uint32_t>& blocks, uint64_t length,
                 const std::vector<uint64_t>* hashes) override;
  bool job_done(Session& session, uint64_t job, bool ok, const std::string& error, const Submitted& counts) override {
    return conns->job_done(session, job, ok, error, counts);
  }
  void flush() override { conns->flush(); }

  LaneConfig config;
  // A tier below DRAM wants committed shards (the disk tier's demotion).
  bool demote_events = false;
  int epoll_fd = -1;
  int event_fd = -1;   // the transports' and the sealer's threads wake the lane's
  int stop_fd = -1;    // Python stops it
  int python_fd = -1;  // the lane wakes Python's loop: events to read
  int timer_fd = -1;   // wakes the lane when a transport's own work is due (Transport::due)
  std::unique_ptr<Slots> slots;
  std::unique_ptr<Index> index;
  Events events;
  std::unique_ptr<Completions> completions;
  std::unique_ptr<Jobs> jobs;
  std::unique_ptr<Conns> conns;
  std::unique_ptr<Sealer> sealer;
  std::unique_ptr<ShmTransport> shm;
  std::unique_ptr<CudaTransport> cuda;
  std::string error;   // the last refusal's message, for kvd_error
  std::string scratch;  // what a call hands back by pointer

 private:
  void run();
  // One round: whatever is ready in the epoll set, the copies that ended.
  void serve(const epoll_event* ready, int n);
  // What the copy threads and the sealer handed over, and the gate's stores
  // due: stores that passed the gate launched, records written, the clients
  // of the copies that ended told and the index settled (the lane's lock held).
  void finish_ended();
  // A copy thread's round (Completions::finish_here).
  bool finish_here();
  void tell_python();
  std::thread thread_;
  bool stopped_ = false;  // under the lock: no copy thread finishes jobs any more
  // The loop's thread waits in epoll_wait: only then does a copy thread that
  // finishes its jobs save a wake-up; a busy loop takes them in its next round.
  std::atomic<bool> asleep_{false};
  std::string taken_;
  bool python_woken_ = false;
  int64_t timer_at_ = 0;  // when the timer was last set to go off (now_ns()'s clock)
};

}  // namespace kvd
