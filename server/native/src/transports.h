// The lane's transports: who moves a job's bytes (core/transport.py). The
// shared-memory one copies between a worker's staging memory and the pool
// (shm.cpp); the CUDA one queues a job's copies on its GPU (cuda*.cpp).
#pragma once

#include "jobs.h"

namespace kvd {

// The CUDA runtime's and driver's entry points, as the torch the daemon runs
// on loaded them (Python hands their addresses over: no CUDA toolkit is needed
// to build the lane, and the lane calls the same CUDA as torch).
struct IpcEventHandle {
  char reserved[64];
};

struct CudaApi {
  int (*set_device)(int);
  int (*memcpy_async)(void* dst, const void* src, size_t bytes, int kind, void* stream);
  int (*event_record)(void* event, void* stream);
  int (*stream_wait_event)(void* stream, void* event, unsigned flags);
  int (*event_query)(void* event);
  int (*event_synchronize)(void* event);
  int (*event_create)(void** event, unsigned flags);
  int (*event_destroy)(void* event);
  int (*ipc_open_event)(void** event, IpcEventHandle handle);
  int (*stream_synchronize)(void* stream);
  const char* (*error_string)(int code);
  int (*launch_kernel)(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shared, void* stream, void** params, void** extra);
};

// A compiled kernel, launched by its handle (cuda_calls.py KernelLaunch).
struct KernelConfig {
  uint64_t function;  // 0: none
  uint32_t block, shared, programs, n_params;
  uint32_t param_sizes[32];
};

// One direction of one GPU, as Python set it up (transports/cuda_streams.py CopyStream).
struct CudaStreamConfig {
  uint64_t stream, kernels;  // cudaStream_t: transfers, gather/scatter kernels
  uint64_t buffers[2];       // staging buffers, `rows` slots each
  uint64_t rows;
  uint64_t filled[2], drained[2];  // cudaEvent_t of each buffer
  uint64_t ring_host, ring_gpu, ring_entries;  // int64 block ids, a store's fence readback and row hashes
  uint64_t positions;                          // int64 0..rows-1 on the GPU
  KernelConfig copy;                           // copy_kernel.py, for the gather or scatter
  // A store's row hashes (hash_kernel.py), their keys and a scratch array per buffer.
  KernelConfig hash_blocks, hash_rows;
  uint64_t hash_keys;
  uint64_t hash_scratch[2];
};

struct CudaDeviceConfig {
  int32_t index;
  uint32_t wait_for_compute;
  uint64_t chunk_bytes, spin_bytes, per_registration;
  CudaStreamConfig store, load;
};

class CudaTransport;

class ShmTransport : public Transport {
 public:
  ShmTransport(uint8_t* pool, uint64_t slot_bytes, Completions& completions);
  ~ShmTransport() override;
  void start(Job& job) override;
  // For the tests' launchers alone: every copy goes to a thread, which first
  // waits while the file hold-all or hold-JOBID exists in `gate`.
  void hold_with(const std::string& gate, int threads);

 private:
  void copy(const Job& job) const;
  void run();
  void spawn(int index);

  void wait_at_gate(uint64_t job) const;
  std::string gate_;
  uint8_t* pool_;
  uint64_t slot_bytes_;
  Completions& completions_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job*> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvd
