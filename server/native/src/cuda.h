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
  void gate_run();

  CudaApi api_;
  uint8_t* pool_;
  uint64_t slot_bytes_;
  Completions& completions_;
  std::unordered_map<int, std::unique_ptr<Device>> devices_;
  int current_device_ = -1;  // the lane's thread's current device, as set_device left it
  // Stores held until their compute event completed, oldest first (cuda_streams.py ComputeGate).
  uint64_t held_at_gate_ = 0;
  std::mutex gate_mutex_;
  std::condition_variable gate_wake_;
  std::deque<Job*> gate_new_;
  std::unordered_set<Job*> gate_abandoned_;
  std::vector<std::pair<Job*, std::string>> gate_done_;  // "" when opened, else why it failed
  bool stopping_ = false;
  std::thread gate_;
};

}  // namespace kvd
