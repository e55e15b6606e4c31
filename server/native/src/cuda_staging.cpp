// A job's copies through its stream's two staging buffers on the GPU
// (cuda_streams.py, cuda.py): per chunk a gather (store) or scatter (load)
// kernel and one cudaMemcpyAsync per run of consecutive slots, ordered by the
// buffers' events.
#include "cuda_streams.h"

namespace kvd {

namespace {
// A job alone gets a small chunk (this share of a full one) where the bus
// would wait for a whole chunk's kernel: a load's last (its scatter follows
// the bus), and a store's first where its first full chunk would be
// SMALL_FIRST_BYTES or more (its gather comes before the bus; below that the
// gather hidden is shorter than the second launch).
constexpr uint64_t SMALL_CHUNK_SHARE = 8, SMALL_FIRST_BYTES = 16 << 20;
// A job of at most this many bytes, one chunk, runs on the copy stream alone:
// its gather (or scatter) and its transfers need no event between them, about
// half the calls of a small job. A bigger job's kernels run on their own
// stream, beside the previous job's transfers: on one stream they would take
// turns, and the bus would idle while each gather runs.
constexpr uint64_t ONE_STREAM_BYTES = 1 << 20;

enum class Small { NONE, FIRST, LAST };

// (first, count) of a job's staging chunks of up to `rows` blocks, with a
// small one first or last (cuda_streams.py staging_chunks, the Python lane's,
// has no small first one).
std::vector<std::pair<uint64_t, uint64_t>> staging_chunks(uint64_t blocks, uint64_t rows, Small where) {
  uint64_t small = 0;
  if (where != Small::NONE && blocks > 1) small = std::max<uint64_t>(1, std::min(blocks, rows) / SMALL_CHUNK_SHARE);
  std::vector<uint64_t> sizes;
  if (where == Small::FIRST && small) sizes.push_back(small);
  for (uint64_t left = blocks - small; left; left -= sizes.back()) sizes.push_back(std::min(rows, left));
  if (where == Small::LAST && small) sizes.push_back(small);
  std::vector<std::pair<uint64_t, uint64_t>> chunks;
  uint64_t first = 0;
  for (uint64_t size : sizes) {
    chunks.push_back({first, size});
    first += size;
  }
  return chunks;
}
}  // namespace

void CudaTransport::copy_via_staging(Job& job, CopyStream& stream, bool to_host, int64_t fence_index, void* end) {
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
  auto buffer_event = [&](int b, uint8_t owner) {
    return reinterpret_cast<void*>(owner == KERNEL_STREAM ? c.filled[b] : c.drained[b]);
  };
  // Records `event` on the owner's stream of buffer b as the mark of its last use.
  auto mark = [&](int b, void* event) {
    stream.mark_last_use(b, event);
    check(api_.event_record(event, stream.of(stream.owner[b])), "cudaEventRecord");
    stream.marked[b] = true;
  };
  auto wait_for_last_use = [&](int b, uint8_t on) {
    if (!stream.marked[b]) mark(b, buffer_event(b, stream.owner[b]));
    check(api_.stream_wait_event(stream.of(on), stream.last_use[b], 0), "cudaStreamWaitEvent");
  };
  auto take_buffer = [&](int b, uint8_t on) {
    uint8_t last = stream.owner[b];
    if (last != NOBODY && last != on) wait_for_last_use(b, on);
    stream.owner[b] = on;
    stream.marked[b] = false;
  };
  // The job's last hand-over records its end event: the one event says both
  // that the buffer is free and that the job ended.
  auto hand_over = [&](int b, bool last_chunk) { mark(b, last_chunk ? end : buffer_event(b, stream.owner[b])); };
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
  Small small = Small::NONE;
  if (!one_stream && stream.idle())
    small = !to_host ? Small::LAST : std::min(n, per_chunk) * pitch >= SMALL_FIRST_BYTES ? Small::FIRST : Small::NONE;
  auto chunks = staging_chunks(n, per_chunk, small);
  for (auto& chunk : chunks) {
    uint64_t first = chunk.first, count = chunk.second;
    bool last_chunk = &chunk == &chunks.back();
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
      if (one_stream && hashing(stream, true)) hash(first, count, b, transfers);
      if (!one_stream) hand_over(b, false);
      // On two streams the hash reads the rows beside the transfer, which
      // only reads them too: the bus does not wait for it. The buffer's next
      // writer is this stream's next gather, or a job on the copy stream
      // alone, which comes after this job's end; the end waits for the job's
      // last hash (below), as the stream's thread reads the hashes then.
      bool hash_beside = !one_stream && hashing(stream, true);
      if (hash_beside) hash(first, count, b, stream.kernels());
      if (hash_beside && last_chunk) {
        if (!stream.hashed) check(api_.event_create(&stream.hashed, EVENT_DISABLE_TIMING), "cudaEventCreate");
        check(api_.event_record(stream.hashed, stream.kernels()), "cudaEventRecord");
      }
      take_buffer(b, COPY_STREAM);
      transfer_runs();
      if (hash_beside && last_chunk) check(api_.stream_wait_event(transfers, stream.hashed, 0), "cudaStreamWaitEvent");
      if (last_chunk && fence_index >= 0)
        // After the copy, and before the event the stream's thread reads it at.
        check(api_.memcpy_async(reinterpret_cast<void*>(c.ring_host + 8 * (uint64_t)fence_index),
                                reinterpret_cast<void*>(job.worker->fence_address), 8, MEMCPY_DEFAULT, transfers),
              "cudaMemcpyAsync");
      if (!one_stream) hand_over(b, last_chunk);
    } else {
      take_buffer(b, COPY_STREAM);
      transfer_runs();
      if (!one_stream) hand_over(b, false);
      stamp(job, TRANSFERS);
      // Only now: the load's first transfer is queued already, and the copy engine does not wait for the upload.
      upload(stream.of(kernel_side));
      take_buffer(b, kernel_side);
      launch(first, count, buffer, stream.of(kernel_side));
      if (!one_stream) hand_over(b, last_chunk);
    }
    stamp(job, FIRST_CHUNK);
  }
  // A store ends with its last transfer, a load with its last scatter: on one
  // stream, the last thing queued on it.
  if (one_stream) check(api_.event_record(end, stream.stream()), "cudaEventRecord");
}

}  // namespace kvd
