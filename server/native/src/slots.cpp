// The pool's free slots per NUMA range (port of server/host/free_slots.py), and
// what releasing a slot does to the pool file (host/pool.py HostPool.release).
#include <pthread.h>

#include <algorithm>
#include <cstdarg>

#include "index.h"

namespace kvd {

std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  char buffer[1024];
  int n = vsnprintf(buffer, sizeof buffer, fmt, args);
  va_end(args);
  if (n < 0) return "";
  return std::string(buffer, std::min<size_t>((size_t)n, sizeof buffer - 1));
}

void name_thread(const std::string& name) { pthread_setname_np(pthread_self(), name.substr(0, 15).c_str()); }

Slots::Slots(int64_t num_slots, std::vector<Range> ranges, uint8_t* records)
    : num_slots_(num_slots), ranges_(std::move(ranges)), records_(records) {
  if (ranges_.empty()) ranges_.push_back({-1, 0, num_slots});
  epochs_.reset(new std::atomic<uint64_t>[num_slots]);
  for (int64_t s = 0; s < num_slots; s++) epochs_[s].store(0, std::memory_order_relaxed);
  online_.assign(num_slots, true);
  online_in_.assign(ranges_.size(), 0);
  for (size_t i = 0; i < ranges_.size(); i++) online_in_[i] = ranges_[i].count;
  online_count_ = num_slots;
  fill({}, false);
}

size_t Slots::range_of(int64_t slot) const {
  size_t i = ranges_.size() - 1;
  while (i > 0 && ranges_[i].first > slot) i--;
  return i;
}

void Slots::set_online(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  online_.assign(num_slots_, false);
  online_in_.assign(ranges_.size(), 0);
  online_count_ = 0;
  for (auto [first, count] : ranges)
    for (int64_t s = std::max<int64_t>(first, 0); s < std::min(first + count, num_slots_); s++)
      if (!online_[s]) {
        online_[s] = true;
        online_in_[range_of(s)]++;
        online_count_++;
      }
  fill({}, false);
}

int64_t Slots::add_online(int64_t first, int64_t count, const std::vector<int64_t>& held) {
  int64_t added = 0;
  std::vector<int64_t> kept(held);
  std::sort(kept.begin(), kept.end());
  // Pushed highest first: the new chunk's lowest slots are taken first.
  for (int64_t s = std::min(first + count, num_slots_) - 1; s >= std::max<int64_t>(first, 0); s--) {
    if (online_[s]) continue;
    online_[s] = true;
    size_t i = range_of(s);
    online_in_[i]++;
    online_count_++;
    added++;
    if (std::binary_search(kept.begin(), kept.end(), s)) {
      kept_waiting_++;
      continue;
    }
    if (records_) std::memset(record(s), 0, RECORD_BYTES);
    stacks_[i].push_back(s);
    free_++;
  }
  return added;
}

void Slots::keep_only(const std::vector<int64_t>& used) { fill(used, true); }

void Slots::fill(const std::vector<int64_t>& used, bool clear_records) {
  std::vector<bool> taken(num_slots_, false);
  for (int64_t s : used)
    if (s >= 0 && s < num_slots_) taken[s] = true;
  stacks_.assign(ranges_.size(), {});
  free_ = 0;
  for (size_t i = 0; i < ranges_.size(); i++) {
    const Range& r = ranges_[i];
    // Popped from the end: lowest slots first.
    for (int64_t s = r.first + r.count - 1; s >= r.first; s--) {
      if (taken[s] || !online_[s]) continue;
      stacks_[i].push_back(s);
      if (clear_records && records_) std::memset(record(s), 0, RECORD_BYTES);
    }
    free_ += (int64_t)stacks_[i].size();
  }
}

int64_t Slots::allocate(int32_t node) {
  std::vector<int64_t>* stack = nullptr;
  if (node >= 0) {
    for (size_t i = 0; i < ranges_.size(); i++)
      if (ranges_[i].node == node) stack = &stacks_[i];
  }
  if (stack == nullptr || stack->empty()) {
    // The range with the most free slots (the first of equals).
    stack = &stacks_[0];
    for (auto& candidate : stacks_)
      if (candidate.size() > stack->size()) stack = &candidate;
    if (stack->empty()) return -1;
  }
  int64_t slot = stack->back();
  stack->pop_back();
  free_--;
  return slot;
}

void Slots::release(int64_t slot) {
  // A block dropped (evicted, cleared) must not come back at a restart, nor a
  // seal still on its way write its record (seal.cpp checks the epoch).
  if (records_) std::memset(record(slot), 0, RECORD_BYTES);
  epochs_[slot].fetch_add(1, std::memory_order_acq_rel);
  stacks_[range_of(slot)].push_back(slot);
  free_++;
}

}  // namespace kvd
