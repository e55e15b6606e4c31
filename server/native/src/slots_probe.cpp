// For tests/test_native_runs.py alone: a Slots of its own (no pool file, no
// lane), driven call by call, so that the test holds it to host/free_runs.py
// choice by choice (both lanes must put blocks in the same slots).
#include "slots.h"

#define KVD_API __attribute__((visibility("default")))

using namespace kvd;

namespace {
Slots::Runs runs_of(const int64_t* firsts, const int64_t* spans, size_t n) {
  Slots::Runs runs;
  for (size_t i = 0; i < n; i++) runs.emplace_back(firsts[i], spans[i]);
  return runs;
}
}  // namespace

extern "C" {

KVD_API Slots* kvd_probe_open(int64_t num_slots, const int32_t* nodes, const int64_t* firsts, const int64_t* counts,
                              size_t n_ranges, int64_t chunk_slots, int64_t extent_slots) {
  std::vector<Slots::Range> ranges;
  for (size_t i = 0; i < n_ranges; i++) ranges.push_back({nodes[i], firsts[i], counts[i]});
  return new Slots(num_slots, ranges, chunk_slots, extent_slots, 1, nullptr);
}

KVD_API void kvd_probe_close(Slots* slots) { delete slots; }

KVD_API int64_t kvd_probe_allocate(Slots* slots, int32_t node, int64_t span) { return slots->allocate(node, span); }

// 0, or 1 where the slot starts no run in use (refused).
KVD_API int kvd_probe_release(Slots* slots, int64_t slot) {
  if (!slots->in_use(slot)) return 1;
  slots->release(slot);
  return 0;
}

KVD_API int64_t kvd_probe_span_at(Slots* slots, int64_t slot) { return slots->span_at(slot); }

// [free, online, kept waiting, max span], then free and online per range.
KVD_API void kvd_probe_counts(Slots* slots, int64_t* out) {
  out[0] = slots->free();
  out[1] = slots->online();
  out[2] = slots->kept_waiting();
  out[3] = slots->max_span();
  for (size_t i = 0; i < slots->ranges().size(); i++) {
    out[4 + 2 * i] = slots->free_in(i);
    out[5 + 2 * i] = slots->online_in(i);
  }
}

KVD_API void kvd_probe_set_online(Slots* slots, const int64_t* firsts, const int64_t* counts, size_t n) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (size_t i = 0; i < n; i++) ranges.emplace_back(firsts[i], counts[i]);
  slots->set_online(ranges);
}

KVD_API int64_t kvd_probe_add_online(Slots* slots, int64_t first, int64_t count, const int64_t* firsts,
                                     const int64_t* spans, size_t n) {
  return slots->add_online(first, count, runs_of(firsts, spans, n));
}

KVD_API void kvd_probe_keep_only(Slots* slots, const int64_t* firsts, const int64_t* spans, size_t n,
                                 int64_t kept_waiting) {
  slots->keep_only(runs_of(firsts, spans, n));
  slots->set_kept_waiting(kept_waiting);
}

}  // extern "C"
