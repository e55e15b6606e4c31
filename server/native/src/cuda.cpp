// The CUDA transport's copies (port of server/transports/cuda.py's job path,
// cuda_jobs.py and cuda_streams.py, whose docstrings say why each step is as
// it is). A job is: its block ids written to its stream's ring and copied up
// in one transfer; per staging chunk a gather (store) or scatter (load) kernel
// and one cudaMemcpyAsync per run of consecutive slots, ordered by the
// buffers' events; a store's fence read back; an event at its end, which the
// stream's thread waits for. A store starts only once its worker's compute
// event has completed (the gate's thread polls it on the host, so that a
// worker killed mid-compute stalls no stream).
#include "cuda.h"

#include <sys/prctl.h>
#include <unistd.h>

namespace kvd {

namespace {
constexpr int MEMCPY_DEFAULT = 4;  // the direction from the addresses (UVA)
constexpr int NOT_READY = 600;     // cudaErrorNotReady
constexpr unsigned EVENT_DISABLE_TIMING = 0x02;
constexpr size_t MAX_EVENTS_PER_WORKER = 1024;
constexpr uint64_t TAIL_CHUNK_SHARE = 8;
// A job of at most this many bytes, one chunk, runs on the copy stream alone:
// its gather (or scatter) and its transfers need no event between them, about
// half the calls of a small job. A bigger job's kernels run on their own
// stream, beside the previous job's transfers: on one stream they would take
// turns, and the bus would idle while each gather runs.
constexpr uint64_t ONE_STREAM_BYTES = 1 << 20;
// Who touched a staging buffer last.
enum Owner : uint8_t { NOBODY = 0, COPY_STREAM = 1, KERNEL_STREAM = 2 };
// A store at the gate is asked at once, then every GATE_POLL_NS for its first
// GATE_FAST_NS (a store submitted just after its compute: the benchmarks'
// case), then every quarter of the time it has waited, at most every
// GATE_SLOW_NS. In serving a store waits for a whole forward pass (tens of
// milliseconds), and asking every 20 us through it kept a core's thread awake
// 50,000 times a second; this way a store is seen at most a quarter of its
// wait, and 1 ms, late. Nor is it asked before 3/4 of the shortest wait of the
// last GATE_RECENT stores that were not done at once: a worker's forward
// passes are alike, and the shortest keeps a short one from being seen late.
constexpr int64_t GATE_POLL_NS = 20000, GATE_FAST_NS = 500000, GATE_SLOW_NS = 1000000;
constexpr size_t GATE_RECENT = 16;

int64_t next_gate_ask(int64_t since, int64_t now, int64_t shortest) {
  int64_t waited = now - since;
  int64_t next = now + (waited < GATE_FAST_NS ? GATE_POLL_NS : std::min(GATE_SLOW_NS, waited / 4));
  return std::max(next, since + shortest / 4 * 3);
}

// A job is expected to start when the one before it on its stream was seen
// to end (or when it was queued, if later) and to move at this many bytes a
// nanosecond, plus JOB_NS; past that its event is asked, first after
// FIRST_POLL_NS, then twice as long each time. The rate is above what PCIe 5
// x16 gives (about 55), so that the sleep ends before the copy does and a busy
// stream's completions are never paced below the bus.
constexpr double NOMINAL_BYTES_PER_NS = 64.0;
constexpr int64_t JOB_NS = 10000, FIRST_POLL_NS = 5000, LAST_POLL_NS = 200000, SPIN_NS = 50000;
// A job that found its stream idle is asked at least this often once it is
// due, for a quarter of its predicted time (ALONE_CLOSE_NS at least): its
// prediction is early by a big job's hundreds of microseconds (a store's
// gather and hash, and the bus below the nominal rate), which the growing
// steps above would turn into seeing it end up to 200 us late. Past that it
// is late for some other reason (its GPU busy with other processes' work,
// docs/operations.md) and is asked as the others are.
constexpr int64_t ALONE_POLL_NS = 10000, ALONE_CLOSE_NS = 200000;
// Stage stamps (server/native/binding.py STAGES).
enum Stage : uint8_t { LAUNCH = 2, IDS_UP = 3, KERNEL = 4, TRANSFERS = 5, FIRST_CHUNK = 6, QUEUED = 7, GPU_DONE = 8 };

void stamp(Job& job, uint8_t stage) {
  if (job.trace.empty()) return;  // not traced
  for (auto& s : job.trace)
    if (s.first == stage) return;
  job.trace.push_back({stage, now_ns()});
}

// (first, count) of a job's staging chunks of up to `rows` blocks; a load alone
// ends with a small chunk (cuda_streams.py staging_chunks).
std::vector<std::pair<uint64_t, uint64_t>> staging_chunks(uint64_t blocks, uint64_t rows, bool small_tail) {
  uint64_t tail = small_tail && blocks > 1 ? std::max<uint64_t>(1, std::min(blocks, rows) / TAIL_CHUNK_SHARE) : 0;
  std::vector<std::pair<uint64_t, uint64_t>> chunks;
  uint64_t first = 0;
  for (uint64_t left = blocks - tail; left;) {
    uint64_t size = std::min(rows, left);
    chunks.push_back({first, size});
    first += size;
    left -= size;
  }
  if (tail) chunks.push_back({first, tail});
  return chunks;
}
}  // namespace

// ---------------------------------------------------------------- the ring's spans

bool Spans::take(uint64_t count, int64_t* start, int64_t* end) {
  uint64_t head = head_;
  if (taken_.empty()) {
    head = 0;
  } else {
    uint64_t oldest = (uint64_t)taken_.front().first;
    if (head > oldest) {  // in use: [oldest, head)
      if (head + count > entries_) {
        head = 0;
        if (count > oldest) return false;
      }
    } else if (head + count > oldest) {  // wrapped; free: [head, oldest)
      return false;
    }
  }
  if (head + count > entries_) return false;
  *start = (int64_t)head;
  *end = (int64_t)(head + count);
  head_ = head + count;
  taken_.push_back({*start, *end});
  return true;
}

void Spans::give_back(int64_t start, int64_t end) {
  if (!taken_.empty() && taken_.front() == std::make_pair(start, end)) {
    taken_.pop_front();
    return;
  }
  for (auto it = taken_.begin(); it != taken_.end(); ++it)
    if (*it == std::make_pair(start, end)) {
      taken_.erase(it);
      return;
    }
}

// ---------------------------------------------------------------- a stream and its thread

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
  bool marked[2] = {false, false};  // owner's event recorded right after its last use of the buffer
  std::deque<Job*> waiting;  // for room in the ring, in order (the lane's thread's)
  int64_t last_end_ns = 0;  // the completion thread's: when it saw the last job end
  std::atomic<uint64_t> tracked{0}, done{0};
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<Tracked> pending;
  bool stopping = false;
  std::mutex spare_mutex;
  std::vector<void*> spare;  // ended events, for reuse
  std::thread thread;

  explicit CopyStream(const CudaStreamConfig& c) : config(c), spans(c.ring_entries) {}
  bool idle() const { return tracked.load() == done.load(); }
  void* stream() const { return reinterpret_cast<void*>(config.stream); }
  void* kernels() const { return reinterpret_cast<void*>(config.kernels); }
  void* of(uint8_t owner) const { return owner == KERNEL_STREAM ? kernels() : stream(); }
  Ended ended(Tracked& item, int rc);
  void wait_for(const Tracked& item);
  void run();
};

Ended CopyStream::ended(Tracked& item, int rc) {
  Job* job = item.job;
  stamp(*job, GPU_DONE);
  if (rc) return Ended{job, false, format("copy failed on the GPU: %s (CUDA error %d)", api->error_string(rc), rc)};
  {
    std::lock_guard<std::mutex> lock(spare_mutex);
    spare.push_back(item.event);
  }
  volatile int64_t* ring = reinterpret_cast<volatile int64_t*>(config.ring_host);
  if (item.hash_index >= 0) {
    job->hashes.resize(item.rows);
    for (uint64_t i = 0; i < item.rows; i++) job->hashes[i] = (uint64_t)ring[item.hash_index + (int64_t)i];
  }
  if (item.fence_index >= 0) {
    if ((uint64_t)ring[item.fence_index] < item.fence_seq)
      // The event fired but the worker never wrote its fence: it died before
      // its compute ended, and the blocks hold no valid data.
      return Ended{job, false, "the worker's compute did not finish (the worker died?)"};
  }
  return Ended{job, true, ""};
}

void CopyStream::wait_for(const Tracked& item) {
  // Asleep until the job should have ended, then asking its event: a few
  // queries a job instead of a wake-up by the driver's event thread for each
  // (cudaEventBlockingSync) or a core spinning. A small job that had the
  // stream to itself is asked closely for a while, so that it is not late.
  // Predicted from the observed end of the job before it, not from that job's
  // prediction: predictions chained at a nominal rate would pace a busy stream
  // at that rate, whatever the bus does.
  int64_t duration = JOB_NS + (int64_t)((double)item.bytes / NOMINAL_BYTES_PER_NS);
  int64_t expected = std::max(last_end_ns, item.queued_ns) + duration;
  int64_t now = now_ns();
  if (expected > now + 2000) std::this_thread::sleep_for(std::chrono::nanoseconds(expected - now));
  int64_t spin_until = item.spin ? now_ns() + SPIN_NS : 0;
  int64_t close_until = item.alone ? std::max(now, expected) + std::max(ALONE_CLOSE_NS, duration / 4) : 0;
  int64_t backoff = FIRST_POLL_NS;
  while (api->event_query(item.event) == NOT_READY) {
    int64_t at = now_ns();
    if (at < spin_until) continue;
    std::this_thread::sleep_for(std::chrono::nanoseconds(backoff));
    backoff = std::min(backoff * 2, at < close_until ? ALONE_POLL_NS : LAST_POLL_NS);
  }
}

void CopyStream::run() {
  api->set_device(device);
  prctl(PR_SET_TIMERSLACK, 1000);  // its sleeps are tens of microseconds: not the default 50 us slack
  std::unique_lock<std::mutex> lock(mutex);
  for (;;) {
    wake.wait(lock, [this] { return stopping || !pending.empty(); });
    if (pending.empty()) return;  // stopping
    Tracked first = pending.front();
    lock.unlock();
    wait_for(first);
    // It, and every job after it that has ended too, go to the loop together.
    std::vector<Tracked> items;
    lock.lock();
    items.push_back(pending.front());
    pending.pop_front();
    while (!pending.empty() && api->event_query(pending.front().event) != NOT_READY) {
      items.push_back(pending.front());
      pending.pop_front();
    }
    lock.unlock();
    last_end_ns = now_ns();
    std::vector<Ended> ended;
    for (Tracked& item : items) ended.push_back(this->ended(item, api->event_query(item.event)));
    done += ended.size();
    completions->push(std::move(ended));
    lock.lock();
  }
}

struct CudaTransport::Device {
  CudaDeviceConfig config;
  std::unique_ptr<CopyStream> store, load;
};

// ---------------------------------------------------------------- the transport

CudaTransport::CudaTransport(const CudaApi& api, uint8_t* pool, uint64_t slot_bytes, Completions& completions)
    : api_(api), pool_(pool), slot_bytes_(slot_bytes), completions_(completions) {
  gate_ = std::thread([this] {
    name_thread("kvdepot-gate");
    gate_run();
  });
}

CudaTransport::~CudaTransport() {
  {
    std::lock_guard<std::mutex> lock(gate_mutex_);
    stopping_ = true;
  }
  gate_wake_.notify_all();
  gate_.join();
  for (auto& entry : devices_)
    for (CopyStream* s : {entry.second->store.get(), entry.second->load.get()}) {
      {
        std::lock_guard<std::mutex> lock(s->mutex);
        s->stopping = true;
      }
      s->wake.notify_all();
      s->thread.join();
      for (void* event : s->spare) api_.event_destroy(event);
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
  if (current_device_ == index) return;
  check(api_.set_device(index), "cudaSetDevice");
  current_device_ = index;
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

void CudaTransport::start(Job& job) {
  if (job.slots.empty()) {
    completions_.push(Ended{&job, true, ""});
    return;
  }
  // Most stores arrive after their compute ended: no trip through the gate,
  // unless stores wait there (they go first).
  if (job.event && (held_at_gate_ || api_.event_query(job.event) != 0)) {
    held_at_gate_++;
    job.at_gate = true;
    {
      std::lock_guard<std::mutex> lock(gate_mutex_);
      gate_new_.push_back(&job);
    }
    gate_wake_.notify_one();
    return;
  }
  launch(job);
}

void CudaTransport::abandon(Job& job) {
  // A store still at the gate is dropped there; copies already queued on the
  // GPU end first (and fail, the session having ended).
  if (!job.at_gate) return;
  {
    std::lock_guard<std::mutex> lock(gate_mutex_);
    gate_abandoned_.insert(&job);
  }
  gate_wake_.notify_one();
}

void CudaTransport::forget(Worker& worker) {
  for (auto& entry : worker.events) api_.event_destroy(entry.second);
  worker.events.clear();
}

void CudaTransport::fail(Job& job, const std::string& reason) { completions_.push(Ended{&job, false, reason}); }

void CudaTransport::gate_run() {
  prctl(PR_SET_TIMERSLACK, 1000);
  struct Waiting {
    Job* job;
    int64_t since, next_ask;
  };
  std::vector<Waiting> waiting;  // in the order they came
  // How long the last GATE_RECENT stores not done at their first ask waited.
  std::deque<int64_t> recent;
  auto shortest = [&recent] { return recent.empty() ? 0 : *std::min_element(recent.begin(), recent.end()); };
  std::unique_lock<std::mutex> lock(gate_mutex_);
  // Stores queued or abandoned while the thread asked events (unlocked) are
  // seen here, not left to the next store due.
  auto news = [this] { return stopping_ || !gate_new_.empty() || !gate_abandoned_.empty(); };
  for (;;) {
    if (waiting.empty()) {
      gate_wake_.wait(lock, news);
    } else {
      int64_t next = waiting.front().next_ask;
      for (const Waiting& w : waiting) next = std::min(next, w.next_ask);
      int64_t left = next - now_ns();
      if (left > 0) gate_wake_.wait_for(lock, std::chrono::nanoseconds(left), news);
    }
    if (stopping_) return;
    int64_t now = now_ns();
    // A store that came is asked at once (it may be done already).
    for (Job* job : gate_new_) waiting.push_back({job, now, now});
    gate_new_.clear();
    std::unordered_set<Job*> abandoned;
    abandoned.swap(gate_abandoned_);
    lock.unlock();
    std::vector<std::pair<Job*, std::string>> done;
    std::vector<Waiting> still;
    std::vector<int64_t> waited;  // of the stores that ended after their first ask
    // A store due that ended: every store before it is asked too, so that
    // stores leave in the order they came (a worker's earlier store, whose
    // compute came first, is done too).
    for (bool all = false;; all = true) {
      bool ended = false;
      for (Waiting& w : waiting) {
        if (abandoned.count(w.job)) {
          done.push_back({w.job, "the client went away before its compute finished"});
          continue;
        }
        if (!all && w.next_ask > now) {
          still.push_back(w);
          continue;
        }
        int rc = api_.event_query(w.job->event);
        if (rc == NOT_READY) {
          still.push_back({w.job, w.since, next_gate_ask(w.since, now, shortest())});
          continue;
        }
        ended = true;
        if (rc == 0 && now > w.since) waited.push_back(now - w.since);
        // One bad event must not stop every other store.
        done.push_back({w.job, rc == 0 ? "" : format("waiting for the worker's compute failed: %s",
                                                      api_.error_string(rc))});
      }
      if (all || !ended) break;
      done.clear();
      still.clear();
      waited.clear();
    }
    for (int64_t w : waited) {
      recent.push_back(w);
      if (recent.size() > GATE_RECENT) recent.pop_front();
    }
    waiting.swap(still);
    lock.lock();
    if (!done.empty()) {
      for (auto& d : done) gate_done_.push_back(std::move(d));
      completions_.poke();
    }
  }
}

void CudaTransport::poll() {
  std::vector<std::pair<Job*, std::string>> done;
  {
    std::lock_guard<std::mutex> lock(gate_mutex_);
    done.swap(gate_done_);
  }
  for (auto& d : done) {
    held_at_gate_--;
    d.first->at_gate = false;
    if (d.second.empty()) launch(*d.first);
    else fail(*d.first, d.second);
  }
}

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
  uint8_t kernel_side = copy_via_staging(job, stream, to_host);
  int64_t fence_index = -1;
  if (job.event) {
    // The fence the worker's compute wrote, read back after the copy.
    fence_index = job.span_start + (int64_t)n;
    check(api_.memcpy_async(reinterpret_cast<void*>(stream.config.ring_host + 8 * fence_index),
                            reinterpret_cast<void*>(job.worker->fence_address), 8, MEMCPY_DEFAULT, stream.stream()),
          "cudaMemcpyAsync");
  }
  // A small job on an idle stream is asked for closely once it should have
  // ended (a sleeping thread would make it late); others are asked less often.
  uint64_t nbytes = n * span(*job.worker) * slot_bytes_;  // its runs of slots
  bool alone = stream.idle(), spin = alone && nbytes <= config.spin_bytes;
  int64_t queued_ns = now_ns();
  void* event = nullptr;
  {
    std::lock_guard<std::mutex> lock(stream.spare_mutex);
    if (!stream.spare.empty()) {
      event = stream.spare.back();
      stream.spare.pop_back();
    }
  }
  if (!event) check(api_.event_create(&event, EVENT_DISABLE_TIMING), "cudaEventCreate");
  // A store ends with its last transfer, a load with its last scatter.
  check(api_.event_record(event, to_host ? stream.stream() : stream.of(kernel_side)), "cudaEventRecord");
  stamp(job, QUEUED);
  stream.tracked++;
  {
    std::lock_guard<std::mutex> lock(stream.mutex);
    int64_t hash_index = hashing(stream, to_host) ? job.span_start + (int64_t)n + 1 : -1;
    stream.pending.push_back(
        Tracked{event, &job, fence_index, job.fence_seq, queued_ns, nbytes, alone, spin, hash_index, n});
  }
  stream.wake.notify_one();
}

uint8_t CudaTransport::copy_via_staging(Job& job, CopyStream& stream, bool to_host) {
  const CudaDeviceConfig& device = devices_.at(job.worker->device_index)->config;
  const CudaStreamConfig& c = stream.config;
  const Worker& w = *job.worker;
  uint64_t n = job.slots.size();
  // A block takes `span` slots in the pool and `span` rows of slot_bytes in a
  // staging buffer: block i of a chunk sits at buffer + i * pitch, and the
  // kernels take the pitch where they took a row's bytes.
  uint64_t span = this->span(w), pitch = span * slot_bytes_, per_chunk = std::max<uint64_t>(1, c.rows / span);
  void* transfers = stream.stream();
  bool uploaded = false;
  auto upload = [&](void* on) {
    if (uploaded) return;
    uint64_t at = 8 * (uint64_t)job.span_start;
    check(api_.memcpy_async(reinterpret_cast<void*>(c.ring_gpu + at), reinterpret_cast<void*>(c.ring_host + at), 8 * n,
                            MEMCPY_DEFAULT, on),
          "cudaMemcpyAsync");
    uploaded = true;
    stamp(job, IDS_UP);
  };
  auto launch = [&](uint64_t first, uint64_t count, uint64_t buffer, void* on) {
    uint64_t chunks = (w.max_page_bytes + device.chunk_bytes - 1) / device.chunk_bytes;
    uint64_t work = count * w.pages_per_block * chunks;
    if (work >= (1ull << 31) - (1ull << 20)) throw std::runtime_error("a job too large for one launch of the copy kernel");
    launch_kernel(c.copy, (unsigned)std::min<uint64_t>(work, c.copy.programs), 1,
                  {c.ring_gpu + 8 * ((uint64_t)job.span_start + first), c.positions, w.table[0], w.table[1], w.table[2],
                   w.table[3], buffer, pitch, w.pages_per_block, chunks, work},
                  on);
    stamp(job, KERNEL);
  };
  // A store's rows hashed where they are, for their records (hash_kernel.py):
  // into the ring's entries after the fence.
  auto hash = [&](uint64_t first, uint64_t count, int b, void* on) {
    uint64_t length = w.block_bytes, per_row = (length + 4095) / 4096;
    launch_kernel(c.hash_blocks, (unsigned)per_row, (unsigned)count,
                  {c.buffers[b], pitch, length, c.hash_keys, c.hash_scratch[b], per_row}, on);
    launch_kernel(c.hash_rows, (unsigned)count, 1,
                  {c.hash_scratch[b], length, per_row, c.ring_host + 8 * ((uint64_t)job.span_start + n + 1 + first)}, on);
  };
  // Before `on` touches buffer b, it waits for the other stream's last use of
  // b. That use is marked (`hand_over`) as soon as it is queued: an event
  // recorded only when the next user comes would also wait for whatever that
  // stream queued since (the next job's transfers, or its kernels), and a
  // stream's transfers would take turns with its kernels instead of
  // overlapping them. Where nothing marked it (the copy stream alone ran the
  // small jobs before), the event is recorded now.
  auto wait_for_last_use = [&](int b, uint8_t on) {
    uint8_t last = stream.owner[b];
    void* event = reinterpret_cast<void*>(last == KERNEL_STREAM ? c.filled[b] : c.drained[b]);
    if (!stream.marked[b]) check(api_.event_record(event, stream.of(last)), "cudaEventRecord");
    stream.marked[b] = true;
    check(api_.stream_wait_event(stream.of(on), event, 0), "cudaStreamWaitEvent");
  };
  auto take_buffer = [&](int b, uint8_t on) {
    uint8_t last = stream.owner[b];
    if (last != NOBODY && last != on) wait_for_last_use(b, on);
    stream.owner[b] = on;
    stream.marked[b] = false;
  };
  auto hand_over = [&](int b) {
    uint8_t last = stream.owner[b];
    void* event = reinterpret_cast<void*>(last == KERNEL_STREAM ? c.filled[b] : c.drained[b]);
    check(api_.event_record(event, stream.of(last)), "cudaEventRecord");
    stream.marked[b] = true;
  };
  bool one_stream = n * pitch <= ONE_STREAM_BYTES && n <= per_chunk;
  uint8_t kernel_side = one_stream ? COPY_STREAM : KERNEL_STREAM;
  if (one_stream && !to_host) {
    // A load on the copy stream alone waits for the buffer it takes, whose
    // last scatter may not be the kernel stream's last: the other buffer's
    // may come later, and into the same GPU blocks. Loads land in the order
    // they were submitted, so it waits for that one too (once, at the turn
    // from two streams to one: the next job takes that buffer anyway).
    int other = 1 - stream.next_buffer;
    if (stream.owner[other] == KERNEL_STREAM) wait_for_last_use(other, COPY_STREAM);
  }
  for (auto& chunk : staging_chunks(n, per_chunk, !one_stream && !to_host && stream.idle())) {
    uint64_t first = chunk.first, count = chunk.second;
    int b = stream.next_buffer;
    stream.next_buffer = (b + 1) % 2;
    uint64_t buffer = c.buffers[b];
    // Blocks whose runs of slots follow each other inside one CUDA
    // registration of the pool (a DMA copy cannot cross two), one transfer
    // each: `count` blocks from block `at` of the chunk.
    struct Run {
      int64_t slot;
      uint64_t at, count;
    };
    std::vector<Run> runs;
    for (uint64_t at = 0; at < count; at++) {
      int64_t slot = job.slots[first + at];
      if (!runs.empty() && runs.back().slot + (int64_t)(runs.back().count * span) == slot &&
          (uint64_t)slot % device.per_registration)
        runs.back().count++;
      else
        runs.push_back({slot, at, 1});
    }
    auto transfer_runs = [&] {
      for (Run& r : runs) {
        uint8_t* pool = pool_ + (uint64_t)r.slot * slot_bytes_;
        void* rows = reinterpret_cast<void*>(buffer + r.at * pitch);
        check(to_host ? api_.memcpy_async(pool, rows, r.count * pitch, MEMCPY_DEFAULT, transfers)
                      : api_.memcpy_async(rows, pool, r.count * pitch, MEMCPY_DEFAULT, transfers),
              "cudaMemcpyAsync");
      }
    };
    if (to_host) {
      take_buffer(b, kernel_side);
      upload(stream.of(kernel_side));
      launch(first, count, buffer, stream.of(kernel_side));
      if (hashing(stream, true)) hash(first, count, b, stream.of(kernel_side));
      if (!one_stream) hand_over(b);
      take_buffer(b, COPY_STREAM);
      transfer_runs();
      if (!one_stream) hand_over(b);
    } else {
      take_buffer(b, COPY_STREAM);
      transfer_runs();
      if (!one_stream) hand_over(b);
      stamp(job, TRANSFERS);
      // Only now: the load's first transfer is queued already, and the copy engine does not wait for the upload.
      upload(stream.of(kernel_side));
      take_buffer(b, kernel_side);
      launch(first, count, buffer, stream.of(kernel_side));
      if (!one_stream) hand_over(b);
    }
    stamp(job, FIRST_CHUNK);
  }
  return kernel_side;
}

void CudaTransport::synchronize() {
  for (auto& entry : devices_)
    for (CopyStream* s : {entry.second->store.get(), entry.second->load.get()}) {
      api_.stream_synchronize(s->stream());
      api_.stream_synchronize(s->kernels());
    }
}

}  // namespace kvd
