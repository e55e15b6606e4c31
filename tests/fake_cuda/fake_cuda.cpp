// A CUDA runtime stand-in for tests/test_native_cuda_fake.py: host memory
// only, every operation done at once, in the order it is queued (one stream
// of work in all, which is an order the real streams may also run in), and the
// copy kernel (server/transports/copy_kernel.py _copy_pages) done on the CPU.
// It lets the native lane's CUDA path run without a GPU: what it checks is the
// lane's bookkeeping (rings, chunks, runs, kernel arguments, completion,
// fences, the gate), not CUDA; pytest -m cuda runs the real thing.
// Each copy and kernel is also logged with a vector clock of the streams, so
// that a test can ask what a real GPU would have had to finish before it:
// which operations the stream order and the event waits put before it.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <atomic>
#include <map>
#include <mutex>
#include <vector>

extern "C" {

// Kernel "functions": which way the copy goes, and the two of the shard hash
// (server/transports/hash_kernel.py, host/shard_hash.py).
const uintptr_t GATHER = 0x1000, SCATTER = 0x2000, HASH_BLOCKS = 0x3000, HASH_ROWS = 0x4000;
// Compute events complete only once released (fake_set_compute_done), except
// those whose handle starts with 'D' (done from the start) or 'R': once
// release_on_ask is set and then a 'D' event has been asked, asking an 'R'
// event releases every compute event (a worker's later compute ending, and
// its earlier ones with it, between two of the gate's asks).
std::atomic<int> compute_done{1}, release_on_ask{0};  // release_on_ask: 0 off, 1 set, 2 a 'D' event asked since
std::atomic<int> launches{0}, copies{0};
// How often a compute event was asked (the gate's polls).
std::atomic<int> compute_queries{0};

// One queued copy ('c') or kernel ('k'): on which stream, its place in that
// stream (1, 2, ...), and what it touched: a copy's destination and source,
// a kernel's function and staging buffer.
struct Op {
  char kind;
  uint64_t stream, seq, function, dst, src, bytes, buffer;
};
using Clock = std::array<uint64_t, 16>;
static std::mutex log_mutex;
static std::vector<Op> ops;
static std::vector<Clock> op_clocks;
static std::map<uint64_t, int> stream_slot;
static std::map<uint64_t, Clock> stream_clock, event_clock;

static int slot_of(void* stream) {
  auto it = stream_slot.find((uint64_t)stream);
  if (it != stream_slot.end()) return it->second;
  int slot = (int)stream_slot.size();
  if (slot >= 16) std::abort();  // a 17th stream would share a clock: the orders read would be wrong
  stream_slot[(uint64_t)stream] = slot;
  return slot;
}
static void log_op(Op op, void* stream) {
  std::lock_guard<std::mutex> lock(log_mutex);
  Clock& clock = stream_clock[(uint64_t)stream];
  op.stream = (uint64_t)stream;
  op.seq = ++clock[slot_of(stream)];
  ops.push_back(op);
  op_clocks.push_back(clock);
}

// The current device is per thread, as CUDA's; a stream given a device
// (fake_stream_device) refuses work queued from a thread whose current device
// is another, as a real stream does (cudaErrorInvalidResourceHandle).
static thread_local int current_device = 0;
static std::map<uint64_t, int> stream_device;
static bool wrong_device(void* stream) {
  std::lock_guard<std::mutex> lock(log_mutex);
  auto it = stream_device.find((uint64_t)stream);
  return it != stream_device.end() && it->second != current_device;
}
void fake_stream_device(void* stream, int device) {
  std::lock_guard<std::mutex> lock(log_mutex);
  stream_device[(uint64_t)stream] = device;
}
int fake_set_device(int device) {
  current_device = device;
  return 0;
}
int fake_memcpy_async(void* dst, const void* src, size_t n, int, void* stream) {
  if (wrong_device(stream)) return 400;
  std::memcpy(dst, src, n);
  copies++;
  log_op(Op{'c', 0, 0, 0, (uint64_t)dst, (uint64_t)src, n, 0}, stream);
  return 0;
}
int fake_event_record(void* event, void* stream) {
  if (wrong_device(stream)) return 400;
  std::lock_guard<std::mutex> lock(log_mutex);
  event_clock[(uint64_t)event] = stream_clock[(uint64_t)stream];
  return 0;
}
int fake_stream_wait_event(void* stream, void* event, unsigned) {
  if (wrong_device(stream)) return 400;
  std::lock_guard<std::mutex> lock(log_mutex);
  Clock& clock = stream_clock[(uint64_t)stream];
  const Clock& seen = event_clock[(uint64_t)event];
  for (int i = 0; i < 16; i++) clock[i] = std::max(clock[i], seen[i]);
  return 0;
}
// The log, for the tests: its length, entry i, whether op i comes before op j
// on a GPU (j's stream has seen i's), and a fresh start.
int fake_ops() {
  std::lock_guard<std::mutex> lock(log_mutex);
  return (int)ops.size();
}
void fake_op(int i, Op* out) {
  std::lock_guard<std::mutex> lock(log_mutex);
  *out = ops.at(i);
}
int fake_before(int i, int j) {
  std::lock_guard<std::mutex> lock(log_mutex);
  return op_clocks.at(j)[stream_slot.at(ops.at(i).stream)] >= ops.at(i).seq;
}
void fake_clear_ops() {
  std::lock_guard<std::mutex> lock(log_mutex);
  ops.clear();
  op_clocks.clear();
}
int fake_event_query(void* event) {
  // An IPC-opened compute event is a tagged pointer: 1 in its low bit, then 2
  // for a 'D' handle's, 4 for an 'R' handle's.
  uintptr_t tag = (uintptr_t)event & 7;
  if (!(tag & 1)) return 0;
  compute_queries++;
  if (tag & 2) {
    int set = 1;
    release_on_ask.compare_exchange_strong(set, 2);
    return 0;
  }
  if ((tag & 4) && release_on_ask.load() == 2) compute_done = 1;
  return compute_done.load() ? 0 : 600;
}
int fake_compute_queries() { return compute_queries; }
int fake_event_synchronize(void*) { return 0; }
int fake_event_create(void** event, unsigned) {
  *event = std::malloc(16);
  return 0;
}
int fake_event_destroy(void* event) {
  if (!((uintptr_t)event & 1)) std::free(event);
  return 0;
}
struct Handle { char reserved[64]; };
int fake_ipc_open_event(void** event, Handle handle) {
  if (handle.reserved[0] == 'X') return 1;  // a handle that is not an event
  static uintptr_t next = 0x100;
  next += 16;
  *event = reinterpret_cast<void*>(next | 1 | (handle.reserved[0] == 'D' ? 2 : 0) | (handle.reserved[0] == 'R' ? 4 : 0));
  return 0;
}
int fake_stream_synchronize(void*) { return 0; }
const char* fake_error_string(int) { return "fake error"; }

static uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

int fake_launch_kernel(void* function, unsigned grid, unsigned grid_y, unsigned, unsigned, unsigned, unsigned, unsigned,
                       void* stream, void** params, void**) {
  auto u64 = [&](int i) { return *reinterpret_cast<uint64_t*>(params[i]); };
  auto u32 = [&](int i) { return (uint64_t)*reinterpret_cast<uint32_t*>(params[i]); };
  if (wrong_device(stream)) return 400;
  uintptr_t f = (uintptr_t)function;
  uint64_t staging = f == HASH_BLOCKS ? u64(0) : f == HASH_ROWS ? 0 : u64(6);
  log_op(Op{'k', 0, 0, f, 0, 0, 0, staging}, stream);
  if ((uintptr_t)function == HASH_BLOCKS) {  // (buffer, slot_bytes, length, keys, out, blocks_per_row)
    const uint8_t* buffer = reinterpret_cast<const uint8_t*>(u64(0));
    uint64_t slot_bytes = u64(1), length = u64(2), per_row = u32(5);
    const uint32_t* keys = reinterpret_cast<const uint32_t*>(u64(3));
    uint64_t* out = reinterpret_cast<uint64_t*>(u64(4));
    if (grid != per_row) return 9;
    for (uint64_t r = 0; r < grid_y; r++)
      for (uint64_t j = 0; j < per_row; j++) {
        uint64_t a = 0, b = 0;
        for (uint64_t i = 0; i < 512 && (j * 512 + i) * 8 < length; i++) {
          uint64_t w;
          std::memcpy(&w, buffer + r * slot_bytes + (j * 512 + i) * 8, 8);
          uint32_t lo = (uint32_t)w, hi = (uint32_t)(w >> 32);
          a += (uint64_t)(uint32_t)(lo + keys[i]) * (uint32_t)(hi + keys[512 + i]);
          b += (uint64_t)(uint32_t)(lo + keys[1024 + i]) * (uint32_t)(hi + keys[1536 + i]);
        }
        out[r * per_row + j] = mix(a ^ mix(b + j + 1));
      }
    launches++;
    return 0;
  }
  if ((uintptr_t)function == HASH_ROWS) {  // (out, length, blocks_per_row, dest)
    const uint64_t* out = reinterpret_cast<const uint64_t*>(u64(0));
    uint64_t length = u64(1), per_row = u32(2);
    uint64_t* dest = reinterpret_cast<uint64_t*>(u64(3));
    for (uint64_t r = 0; r < grid; r++) {
      uint64_t total = 0;
      for (uint64_t j = 0; j < per_row; j++) total += out[r * per_row + j];
      dest[r] = mix(total + length);
    }
    launches++;
    return 0;
  }
  const int64_t* ids = reinterpret_cast<const int64_t*>(u64(0));
  const int64_t* rows = reinterpret_cast<const int64_t*>(u64(1));
  const int64_t* page_gpu = reinterpret_cast<const int64_t*>(u64(2));
  const int64_t* page_stride = reinterpret_cast<const int64_t*>(u64(3));
  const int64_t* page_offset = reinterpret_cast<const int64_t*>(u64(4));
  const int64_t* page_bytes = reinterpret_cast<const int64_t*>(u64(5));
  uint64_t buffer = u64(6), slot_bytes = u64(7), pages = u32(8), chunks = u32(9), work = u32(10);
  if (grid == 0 || grid > work) return 9;  // cudaErrorInvalidConfiguration
  uint64_t count = work / (pages * chunks);
  for (uint64_t i = 0; i < count; i++)
    for (uint64_t k = 0; k < pages; k++) {
      uint8_t* gpu = reinterpret_cast<uint8_t*>(page_gpu[k] + ids[i] * page_stride[k]);
      uint8_t* host = reinterpret_cast<uint8_t*>(buffer + rows[i] * slot_bytes + page_offset[k]);
      if ((uintptr_t)function == GATHER) std::memcpy(host, gpu, page_bytes[k]);
      else std::memcpy(gpu, host, page_bytes[k]);
    }
  launches++;
  return 0;
}

void fake_set_compute_done(int done) { compute_done = done; }
void fake_set_release_on_ask(int on) { release_on_ask = on; }
int fake_launches() { return launches; }
}
