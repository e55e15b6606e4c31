// A GPU's copy streams (port of server/transports/cuda_streams.py): per
// direction a stream, its ring of block ids and the thread that sees its jobs
// end. What the CUDA transport's files (cuda.cpp, cuda_gate.cpp,
// cuda_staging.cpp) share; nothing outside them includes it.
#pragma once

#include "cuda.h"

namespace kvd {

constexpr int MEMCPY_DEFAULT = 4;  // the direction from the addresses (UVA)
constexpr int NOT_READY = 600;     // cudaErrorNotReady
constexpr unsigned EVENT_DISABLE_TIMING = 0x02;
// Who touched a staging buffer last.
enum Owner : uint8_t { NOBODY = 0, COPY_STREAM = 1, KERNEL_STREAM = 2 };
// Stage stamps (server/native/binding.py STAGES).
enum Stage : uint8_t { LAUNCH = 2, IDS_UP = 3, KERNEL = 4, TRANSFERS = 5, FIRST_CHUNK = 6, QUEUED = 7, GPU_DONE = 8 };

// Stamps a traced job's stage, once.
void stamp(Job& job, uint8_t stage);

// Runs of consecutive entries of a ring, taken in order and given back
// (mostly) in order as jobs end (cuda_streams.py Spans).
class Spans {
 public:
  explicit Spans(uint64_t entries) : entries_(entries) {}
  bool take(uint64_t count, int64_t* start, int64_t* end);
  void give_back(int64_t start, int64_t end);

 private:
  uint64_t entries_;
  uint64_t head_ = 0;
  std::deque<std::pair<int64_t, int64_t>> taken_;
};

struct Tracked {
  void* event;
  Job* job;
  int64_t fence_index;  // -1: no fence to check
  uint64_t fence_seq;
  int64_t queued_ns;    // when the lane's thread queued it
  uint64_t bytes;       // what it moves
  bool alone;           // it found the stream idle
  bool spin;            // a small job that found the stream idle: polled closely
  int64_t hash_index;   // where the GPU wrote its rows' hashes in the ring; -1: none
  uint64_t rows;
};

struct CopyStream {
  CudaStreamConfig config;
  int device = 0;
  const CudaApi* api = nullptr;
  Completions* completions = nullptr;
  Spans spans;
  int next_buffer = 0;
  uint8_t owner[2] = {NOBODY, NOBODY};
  bool marked[2] = {false, false};  // an event recorded right after the owner's last use of the buffer
  void* last_use[2] = {nullptr, nullptr};  // that event (where marked): the buffer's, or a job's end
  bool last_use_ended[2] = {false, false};  // it is the end of a job that ended: spare once replaced
  // Makes `event` buffer b's last use, giving back the one it replaces where its job has ended.
  void mark_last_use(int b, void* event) {
    if (last_use_ended[b]) spare.push_back(last_use[b]);
    last_use_ended[b] = false;
    last_use[b] = event;
  }
  std::deque<Job*> waiting;  // for room in the ring, in order (the lane's thread's)
  int64_t last_end_ns = 0;  // the completion thread's: when it saw the last job end
  double rate = 0;          // the completion thread's: bytes a ns its jobs were seen to move, smoothed (0: none yet)
  std::atomic<uint64_t> tracked{0}, done{0};
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<Tracked> pending;
  bool stopping = false;
  std::vector<void*> spare;  // the lane's, as `waiting`: ended jobs' events, for reuse
  void* hashed = nullptr;    // recorded after a store's last hash on the kernel stream (made at first use)
  std::thread thread;

  explicit CopyStream(const CudaStreamConfig& c) : config(c), spans(c.ring_entries) {}
  bool idle() const { return tracked.load() == done.load(); }
  void* stream() const { return reinterpret_cast<void*>(config.stream); }
  void* kernels() const { return reinterpret_cast<void*>(config.kernels); }
  void* of(uint8_t owner) const { return owner == KERNEL_STREAM ? kernels() : stream(); }
  Ended ended(Tracked& item, int rc);
  struct Waited {
    int64_t start;   // when the job was expected to start
    double rate;     // the bytes a ns it was predicted to move at
    bool overslept;  // it was done at the first ask
    int rc;          // what the last ask answered: 0, or why the copy failed
  };
  Waited wait_for(const Tracked& item);
  // Learns the stream's rate from a job seen ended.
  void saw(const Tracked& item, const Waited& waited, int64_t seen);
  void run();
};

struct CudaTransport::Device {
  CudaDeviceConfig config;
  std::unique_ptr<CopyStream> store, load;
};

}  // namespace kvd
