// The CUDA transport's copies (port of server/transports/cuda.py's job path,
// cuda_jobs.py and cuda_streams.py, whose docstrings say why each step is as
// it is). A job is: its block ids written to its stream's ring and copied up
// in one transfer; per staging chunk a gather (store) or scatter (load) kernel
// and one cudaMemcpyAsync per run of consecutive slots, ordered by the
// buffers' events; a store's fence read back; an event at its end, which the
// stream's thread waits for (here it is also the event that hands the job's
// last staging buffer over, where the Python lane records one more). A store
// starts only once its worker's compute
// event has completed (the lane's thread asks it on the host, so that a
// worker killed mid-compute stalls no stream). Its parts: cuda_streams.cpp (the
// streams' threads), cuda_gate.cpp (the gate), cuda_staging.cpp (a job's copies).
#include "cuda_streams.h"

namespace kvd {

namespace {
constexpr size_t MAX_EVENTS_PER_WORKER = 1024;
}  // namespace

// ---------------------------------------------------------------- the transport

CudaTransport::CudaTransport(const CudaApi& api, uint8_t* pool, uint64_t slot_bytes, Completions& completions)
    : api_(api), pool_(pool), slot_bytes_(slot_bytes), completions_(completions) {}

CudaTransport::~CudaTransport() {
  for (auto& entry : devices_)
    for (CopyStream* s : {entry.second->store.get(), entry.second->load.get()}) {
      {
        std::lock_guard<std::mutex> lock(s->mutex);
        s->stopping = true;
      }
      s->wake.notify_all();
      s->thread.join();
      for (void* event : s->spare) api_.event_destroy(event);
      if (s->hashed) api_.event_destroy(s->hashed);
      for (int b = 0; b < 2; b++)
        if (s->last_use_ended[b]) api_.event_destroy(s->last_use[b]);
    }
}

bool CudaTransport::has_device(int index) const { return devices_.count(index) != 0; }

bool CudaTransport::hashing(const CopyStream& stream, bool to_host) { return to_host && stream.config.hash_blocks.function; }

uint64_t CudaTransport::entries(const Job& job, const CopyStream& stream) {
  // Its block ids, then a store's fence readback, then its rows' hashes where the GPU hashes them.
  uint64_t n = job.slots.size();
  return n + 1 + (hashing(stream, job.kind == JobKind::STORE) ? n : 0);
}

void CudaTransport::add_device(const CudaDeviceConfig& config) {
  auto device = std::make_unique<Device>();
  device->config = config;
  device->store.reset(new CopyStream(config.store));
  device->load.reset(new CopyStream(config.load));
  const char* names[2] = {"kvdepot-store-", "kvdepot-load-"};
  int i = 0;
  for (CopyStream* s : {device->store.get(), device->load.get()}) {
    s->device = config.index;
    s->api = &api_;
    s->completions = &completions_;
    std::string name = names[i++] + std::to_string(config.index);
    s->thread = std::thread([s, name] {
      name_thread(name);
      s->run();
    });
  }
  devices_[config.index] = std::move(device);
}

uint64_t CudaTransport::span(const Worker& worker) const {
  return std::max<uint64_t>(1, (worker.block_bytes + slot_bytes_ - 1) / slot_bytes_);
}

void CudaTransport::open_worker(Worker& worker, int device, const uint64_t table[4], uint64_t pages_per_block,
                                uint64_t max_page_bytes, uint64_t fence) {
  const CudaDeviceConfig& config = devices_.at(device)->config;
  // A block takes `span` rows of a staging buffer (cuda.py checks this first, with the option to raise).
  if (span(worker) > std::min(config.store.rows, config.load.rows))
    throw Refusal{INVALID_ARGUMENT, format("a block of %llu bytes does not fit the GPU's staging buffers",
                                           (unsigned long long)worker.block_bytes)};
  worker.device_index = device;
  std::memcpy(worker.table, table, sizeof worker.table);
  worker.pages_per_block = pages_per_block;
  worker.max_page_bytes = max_page_bytes;
  worker.fence_address = fence;
}

void CudaTransport::launch_kernel(const KernelConfig& k, unsigned gx, unsigned gy, std::initializer_list<uint64_t> args,
                                  void* on) {
  uint64_t values[32] = {};
  void* params[32];
  const uint64_t* given = args.begin();
  for (uint32_t i = 0; i < k.n_params && i < 32; i++) {
    values[i] = i < args.size() ? given[i] : 0;  // past the kernel's own: Triton's scratch pointers, null
    if (k.param_sizes[i] == 4) values[i] &= 0xFFFFFFFFull;  // its low half, little-endian
    params[i] = &values[i];
  }
  check(api_.launch_kernel(reinterpret_cast<void*>(k.function), gx, gy, 1, k.block, 1, 1, k.shared, on, params, nullptr),
        "cuLaunchKernel");
}

void CudaTransport::check(int code, const char* what) const {
  if (code) throw std::runtime_error(format("%s failed: %s (CUDA error %d)", what, api_.error_string(code), code));
}

void CudaTransport::set_device(int index) {
  // The current device is per thread: cached for the lane's thread only, not
  // for a Python thread that queues a job (a gRPC submit) between its own calls.
  if (on_lane_thread && current_device_ == index) return;
  check(api_.set_device(index), "cudaSetDevice");
  if (on_lane_thread) current_device_ = index;
}

void CudaTransport::prepare(Worker& worker, Job& job, const JobRequest& request) {
  Device& device = *devices_.at(worker.device_index);
  if (job.kind != JobKind::STORE || !device.config.wait_for_compute) return;
  if (request.event_len != sizeof(IpcEventHandle))
    throw Refusal{INVALID_ARGUMENT,
                  "a CUDA store needs cuda_event_handle: the 64-byte IPC handle of an event recorded after the "
                  "compute that wrote the blocks"};
  std::string handle(reinterpret_cast<const char*>(request.event), request.event_len);
  auto found = worker.events.find(handle);
  if (found == worker.events.end()) {
    if (worker.events.size() >= MAX_EVENTS_PER_WORKER)
      throw Refusal{INVALID_ARGUMENT, format("the worker has used %zu different compute events; reuse them",
                                             MAX_EVENTS_PER_WORKER)};
    set_device(worker.device_index);
    IpcEventHandle h;
    std::memcpy(h.reserved, request.event, sizeof h.reserved);
    void* event = nullptr;
    int rc = api_.ipc_open_event(&event, h);
    if (rc)
      throw Refusal{INVALID_ARGUMENT, format("cannot open the store's cuda_event_handle: %s (CUDA error %d)",
                                             api_.error_string(rc), rc)};
    found = worker.events.emplace(handle, event).first;
  }
  job.event = found->second;
  job.fence_seq = request.fence_seq;
}

void CudaTransport::forget(Worker& worker) {
  for (auto& entry : worker.events) api_.event_destroy(entry.second);
  worker.events.clear();
}

void CudaTransport::fail(Job& job, const std::string& reason) { completions_.push(Ended{&job, false, reason}); }

void CudaTransport::launch(Job& job) {
  stamp(job, LAUNCH);
  if (job.session->ended) {
    fail(job, "the client went away before its compute finished");
    return;
  }
  bool to_host = job.kind == JobKind::STORE;
  Device& device = *devices_.at(job.worker->device_index);
  CopyStream& stream = to_host ? *device.store : *device.load;
  if (!stream.waiting.empty() || !stream.spans.take(entries(job, stream), &job.span_start, &job.span_end)) {
    stream.waiting.push_back(&job);  // its turn comes as earlier jobs give their entries back
    return;
  }
  try {
    enqueue(job, stream, to_host);
  } catch (std::exception& e) {
    // Whatever part was queued must end before the slots can be reused.
    api_.stream_synchronize(stream.stream());
    api_.stream_synchronize(stream.kernels());
    fail(job, format("the daemon could not start the copy: %s", e.what()));
  }
}

void CudaTransport::ended(Job& job) {
  if (job.span_start < 0) return;
  Device& device = *devices_.at(job.worker->device_index);
  CopyStream& stream = job.kind == JobKind::STORE ? *device.store : *device.load;
  stream.spans.give_back(job.span_start, job.span_end);
  job.span_start = job.span_end = -1;
  if (job.copy_event) {
    // An event that marks a buffer's last use is reused only once the buffer
    // has a newer one: the next job to take the buffer may still wait for it.
    int b = stream.last_use[0] == job.copy_event ? 0 : stream.last_use[1] == job.copy_event ? 1 : -1;
    if (b < 0) stream.spare.push_back(job.copy_event);
    else stream.last_use_ended[b] = true;
    job.copy_event = nullptr;
  }
  // Jobs that waited for room go now, in order, as long as there is room.
  while (!stream.waiting.empty()) {
    Job* next = stream.waiting.front();
    if (next->session->ended) {
      stream.waiting.pop_front();
      fail(*next, "the client went away before its copy started");
      continue;
    }
    if (!stream.spans.take(entries(*next, stream), &next->span_start, &next->span_end)) break;
    stream.waiting.pop_front();
    try {
      enqueue(*next, stream, next->kind == JobKind::STORE);
    } catch (std::exception& e) {
      api_.stream_synchronize(stream.stream());
      api_.stream_synchronize(stream.kernels());
      fail(*next, format("the daemon could not start the copy: %s", e.what()));
    }
  }
}

void CudaTransport::enqueue(Job& job, CopyStream& stream, bool to_host) {
  const CudaDeviceConfig& config = devices_.at(job.worker->device_index)->config;
  uint64_t n = job.slots.size();
  set_device(config.index);
  int64_t* host = reinterpret_cast<int64_t*>(stream.config.ring_host);
  for (uint64_t i = 0; i < n; i++) host[job.span_start + i] = job.block_ids[i];
  // A small job on an idle stream is asked for closely once it should have
  // ended (a sleeping thread would make it late); others are asked less often.
  uint64_t nbytes = n * span(*job.worker) * slot_bytes_;  // its runs of slots
  bool alone = stream.idle(), spin = alone && nbytes <= config.spin_bytes;
  int64_t queued_ns = now_ns();
  if (stream.spare.empty()) {
    check(api_.event_create(&job.copy_event, EVENT_DISABLE_TIMING), "cudaEventCreate");
  } else {
    job.copy_event = stream.spare.back();
    stream.spare.pop_back();
  }
  // The fence the worker's compute wrote, read back after the copy.
  int64_t fence_index = job.event ? job.span_start + (int64_t)n : -1;
  copy_via_staging(job, stream, to_host, fence_index, job.copy_event);
  stamp(job, QUEUED);
  stream.tracked++;
  {
    std::lock_guard<std::mutex> lock(stream.mutex);
    int64_t hash_index = hashing(stream, to_host) ? job.span_start + (int64_t)n + 1 : -1;
    stream.pending.push_back(
        Tracked{job.copy_event, &job, fence_index, job.fence_seq, queued_ns, nbytes, alone, spin, hash_index, n});
  }
  stream.wake.notify_one();
}

void CudaTransport::synchronize() {
  for (auto& entry : devices_)
    for (CopyStream* s : {entry.second->store.get(), entry.second->load.get()}) {
      api_.stream_synchronize(s->stream());
      api_.stream_synchronize(s->kernels());
    }
}

}  // namespace kvd
