// What the files of C functions Python calls (capi.cpp, capi_index.cpp) share.
#pragma once

#include <exception>

#include "lane_impl.h"

#define KVD_API __attribute__((visibility("default")))

namespace kvd::capi {

template <class F>
inline int guarded(Lane* lane, F&& body) {
  try {
    body();
    return 0;
  } catch (Refusal& r) {
    lane->error = r.message;
    return r.code;
  } catch (std::exception& e) {
    lane->error = e.what();
    return INTERNAL;
  }
}

inline std::vector<Key> keys_of(const uint8_t* blob, uint32_t n) {
  std::vector<Key> keys(n);
  if (n) std::memcpy(keys.data(), blob, (size_t)n * KEY_BYTES);
  return keys;
}

inline void put_counters(const Counters& c, uint64_t* out) { std::memcpy(out, c.v, sizeof c.v); }

inline Slots::Runs runs_of(const int64_t* firsts, const int64_t* spans, size_t n) {
  Slots::Runs runs;
  for (size_t i = 0; i < n; i++) runs.emplace_back(firsts[i], spans[i]);
  return runs;
}

// The slots of the runs that start at `slots` (those in use).
inline int64_t run_slots(const Slots& pool, const int64_t* slots, size_t n) {
  int64_t total = 0;
  for (size_t i = 0; i < n; i++) total += pool.in_use(slots[i]) ? pool.span_at(slots[i]) : 0;
  return total;
}

}  // namespace kvd::capi
