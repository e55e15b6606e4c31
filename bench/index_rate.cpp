// The native index's part of a job, per block, with no wire and no copy:
// reserve a store of 64 new keys and commit it (evicting the oldest blocks
// once the pool is full, as a busy node does), then reserve a load of the
// same keys and end it. Built and run by bench/index_rate.py.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "index.h"

using namespace kvd;

namespace {
struct QuietHooks : IndexHooks {
  void changed(const Namespace&, const Key&, Change) override {}
  void evicted(Namespace&) override {}
  void committed(Namespace&, uint32_t, const std::vector<uint32_t>&, uint64_t, const std::vector<uint64_t>*) override {}
};
constexpr uint64_t SLOT_BYTES = 64 << 10;
constexpr size_t JOB_BLOCKS = 64;
}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: index_rate SLOTS SPAN JOBS\n");
    return 2;
  }
  int64_t num_slots = std::atoll(argv[1]), span = std::atoll(argv[2]);
  int jobs = std::atoi(argv[3]);
  std::vector<uint8_t> records((size_t)num_slots * RECORD_BYTES);
  Slots slots(num_slots, {{-1, 0, num_slots}}, 16384, 4096, SLOT_BYTES, records.data());
  QuietHooks hooks;
  Index index(slots, hooks, false, num_slots, 12345);
  Namespace& ns = index.add_namespace(1, index.scope("bench", -1), 1, "bench");
  std::mt19937_64 rng(7);
  std::vector<Key> keys((size_t)jobs * JOB_BLOCKS);
  for (Key& k : keys)
    for (size_t i = 0; i < KEY_BYTES; i += 8) {
      uint64_t v = rng();
      std::memcpy(k.b + i, &v, 8);
    }
  std::chrono::nanoseconds stores{0}, loads{0};
  std::vector<uint32_t> written;
  for (int j = 0; j < jobs; j++) {
    const Key* job = keys.data() + (size_t)j * JOB_BLOCKS;
    auto t0 = std::chrono::steady_clock::now();
    Index::Reservation r = index.reserve_store(ns, 0, job, JOB_BLOCKS, j, -1, span);
    written.clear();
    for (auto& w : r.writes) written.push_back(w.second);
    index.finish_stores(written, 0, true, span * SLOT_BYTES);
    auto t1 = std::chrono::steady_clock::now();
    index.finish_loads(index.reserve_load(ns, job, JOB_BLOCKS, 0, span * SLOT_BYTES));
    auto t2 = std::chrono::steady_clock::now();
    if (r.not_stored) {
      std::fprintf(stderr, "job %d: %u blocks not stored\n", j, r.not_stored);
      return 1;
    }
    stores += t1 - t0;
    loads += t2 - t1;
  }
  double blocks = (double)jobs * JOB_BLOCKS;
  std::printf("%.0f %.0f %zu\n", (double)stores.count() / blocks, (double)loads.count() / blocks,
              index.eviction_size());
}
