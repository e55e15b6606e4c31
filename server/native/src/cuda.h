// The CUDA transport's copies in the lane (port of server/transports/cuda.py's
// job path, cuda_jobs.py and cuda_streams.py): per GPU and direction a copy
// stream, its ring of block ids and the thread that reports its jobs as they
// end; and the gate that holds stores until their worker's compute is done.
#pragma once

#include "transports.h"

namespace kvd {

struct CopyStream;

class CudaTransport : public Transport {
 public:
  CudaTransport(const CudaApi& api, uint8_t* pool, uint64_t slot_bytes, Completions& completions);
  ~CudaTransport() override;
  void add_device(const CudaDeviceConfig& config);
  bool has_device(int index) const;
  // A worker's page table on its GPU, and its fence.
  void open_worker(Worker& worker, int device, const uint64_t table[4], uint64_t pages_per_block,
                   uint64_t max_page_bytes, uint64_t fence);

  void prepare(Worker& worker, Job& job, const JobRequest& request) override;
  void start(Job& job) override;
  void abandon(Job& job) override;
  void forget(Worker& worker) override;
  void poll() override;
  int64_t due() const override { return gate_due_; }
  void ended(Job& job) override;
  // Waits for every copy queued: the pool is unpinned after this.
  void synchronize();

 private:
  struct Device;
  void launch(Job& job);
  void enqueue(Job& job, CopyStream& stream, bool to_host);
  // Queues the job's chunks, a store's fence readback (into the ring's entry
  // `fence_index`; -1: none) and `end` after them.
  void copy_via_staging(Job& job, CopyStream& stream, bool to_host, int64_t fence_index, void* end);
  void fail(Job& job, const std::string& reason);
  void launch_kernel(const KernelConfig& kernel, unsigned gx, unsigned gy, std::initializer_list<uint64_t> args,
                     void* on);
  static bool hashing(const CopyStream& stream, bool to_host);
  static uint64_t entries(const Job& job, const CopyStream& stream);
  void check(int code, const char* what) const;
  void set_device(int index);
  // The slots (and staging rows) one of the worker's blocks takes.
  uint64_t span(const Worker& worker) const;
  // One round of the gate: asks the stores due (every store where one is
  // done), and launches those whose compute ended, in the order they came.
  void gate_round(int64_t now);
  // The shortest of the recent stores' waits (0: none yet).
  int64_t shortest_wait() const;

  CudaApi api_;
  uint8_t* pool_;
  uint64_t slot_bytes_;
  Completions& completions_;
  std::unordered_map<int, std::unique_ptr<Device>> devices_;
  int current_device_ = -1;  // the lane's thread's current device, as set_device left it
  // Stores held until their compute event completed, in the order they came
  // (cuda_streams.py ComputeGate); the lane's thread asks them when due.
  struct Waiting {
    Job* job;
    int64_t since, next_ask;
    int64_t not_done_at;  // when an ask last found it not done; -1: never
  };
  std::vector<Waiting> gate_;
  int64_t gate_due_ = INT64_MAX;  // the earliest next_ask at the gate
  // How long the last stores not done at their first ask waited.
  std::deque<int64_t> recent_;
};

}  // namespace kvd
