// The shared-memory transport's copies (port of the copy path of
// server/transports/shared_memory.py): between a worker's staging rows, which
// the daemon mapped when the worker registered, and pool slots. A small job is
// copied on the loop's thread (less than handing it to a thread and back), a
// larger one by one of two copy threads; either way its end reaches the loop
// through the completions, never inside its own submit.
#include "transports.h"

#include <unistd.h>

namespace kvd {

// A job of at most this many bytes is copied on the loop (shared_memory.py INLINE_BYTES).
constexpr uint64_t INLINE_BYTES = 256 << 10;
constexpr int COPY_THREADS = 2;

ShmTransport::ShmTransport(uint8_t* pool, uint64_t slot_bytes, Completions& completions)
    : pool_(pool), slot_bytes_(slot_bytes), completions_(completions) {
  for (int i = 0; i < COPY_THREADS; i++) spawn(i);
}

void ShmTransport::spawn(int index) {
  threads_.emplace_back([this, index] {
    name_thread("kvdepot-shm-" + std::to_string(index));
    run();
  });
}

void ShmTransport::hold_with(const std::string& gate, int threads) {
  gate_ = gate;
  for (int i = (int)threads_.size(); i < threads; i++) spawn(i);
}

void ShmTransport::wait_at_gate(uint64_t job) const {
  std::string all = gate_ + "/hold-all", mine = gate_ + "/hold-" + std::to_string(job);
  while (access(all.c_str(), F_OK) == 0 || access(mine.c_str(), F_OK) == 0) usleep(10000);
}

ShmTransport::~ShmTransport() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ShmTransport::copy(const Job& job) const {
  // Bounds were checked before anything was reserved: block ids against the
  // worker's blocks (which its staging covers), slots by the index.
  const Worker& w = *job.worker;
  uint64_t row = w.block_bytes;
  for (size_t i = 0; i < job.slots.size(); i++) {
    uint8_t* slot = pool_ + (uint64_t)job.slots[i] * slot_bytes_;
    uint8_t* staged = w.staging + (uint64_t)job.block_ids[i] * row;
    if (job.kind == JobKind::STORE) std::memcpy(slot, staged, row);
    else std::memcpy(staged, slot, row);
  }
}

void ShmTransport::start(Job& job) {
  if (gate_.empty() && job.slots.size() * job.worker->block_bytes <= INLINE_BYTES) {
    copy(job);
    completions_.push(Ended{&job, true, ""});
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(&job);
  }
  wake_.notify_one();
}

void ShmTransport::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    // Copies that end while others wait are handed to the loop together.
    std::vector<Ended> ended;
    while (!queue_.empty()) {
      Job* job = queue_.front();
      queue_.pop_front();
      lock.unlock();
      if (!gate_.empty()) wait_at_gate(job->id);
      copy(*job);
      ended.push_back(Ended{job, true, ""});
      lock.lock();
    }
    lock.unlock();
    completions_.push(std::move(ended));
    lock.lock();
  }
}

}  // namespace kvd
