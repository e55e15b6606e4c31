// A CUDA runtime stand-in for tests/test_native_cuda_fake.py: host memory
// only, every operation done at once, in the order it is queued (one stream
// of work in all, which is an order the real streams may also run in), and the
// copy kernel (server/transports/copy_kernel.py _copy_pages) done on the CPU.
// It lets the native lane's CUDA path run without a GPU: what it checks is the
// lane's bookkeeping (rings, chunks, runs, kernel arguments, completion,
// fences, the gate), not CUDA; pytest -m cuda runs the real thing.
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <atomic>

extern "C" {

// Kernel "functions": which way the copy goes.
const uintptr_t GATHER = 0x1000, SCATTER = 0x2000;
// Compute events whose handle starts with this byte complete only once released.
std::atomic<int> compute_done{1};
std::atomic<int> launches{0}, copies{0};

int fake_set_device(int) { return 0; }
int fake_memcpy_async(void* dst, const void* src, size_t n, int, void*) {
  std::memcpy(dst, src, n);
  copies++;
  return 0;
}
int fake_event_record(void*, void*) { return 0; }
int fake_stream_wait_event(void*, void*, unsigned) { return 0; }
int fake_event_query(void* event) {
  // An IPC-opened compute event is a tagged pointer: 1 in its low bit.
  if (((uintptr_t)event & 1) && !compute_done.load()) return 600;
  return 0;
}
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
  *event = reinterpret_cast<void*>(next | 1);
  return 0;
}
int fake_stream_synchronize(void*) { return 0; }
const char* fake_error_string(int) { return "fake error"; }

int fake_launch_kernel(void* function, unsigned grid, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       void*, void** params, void**) {
  auto u64 = [&](int i) { return *reinterpret_cast<uint64_t*>(params[i]); };
  auto u32 = [&](int i) { return (uint64_t)*reinterpret_cast<uint32_t*>(params[i]); };
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
int fake_launches() { return launches; }
}
