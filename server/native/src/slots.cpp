// The pool's runs of slots (port of server/host/free_runs.py: the same
// choices in the same order, so that both lanes put blocks in the same
// slots), and what releasing a run does to the pool file.
#include "slots.h"

#include <pthread.h>

#include <algorithm>
#include <cstdarg>

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

Slots::Slots(int64_t num_slots, std::vector<Range> ranges, int64_t chunk_slots, int64_t extent_slots,
             uint64_t slot_bytes, uint8_t* records)
    : num_slots_(num_slots), ranges_(std::move(ranges)), slot_bytes_(std::max<uint64_t>(1, slot_bytes)),
      records_(records) {
  if (ranges_.empty()) ranges_.push_back({-1, 0, num_slots});
  epochs_.reset(new std::atomic<uint64_t>[std::max<int64_t>(1, num_slots)]);
  for (int64_t s = 0; s < num_slots; s++) epochs_[s].store(0, std::memory_order_relaxed);
  if (chunk_slots <= 0) chunk_slots = std::max<int64_t>(1, num_slots);
  extent_slots = std::max<int64_t>(1, std::min(extent_slots > 0 ? extent_slots : chunk_slots, chunk_slots));
  // free_runs.py cut_extents: never across a range or a registration chunk.
  for (size_t i = 0; i < ranges_.size(); i++) {
    int64_t at = ranges_[i].first, end = ranges_[i].first + ranges_[i].count;
    while (at < end) {
      int64_t chunk_end = std::min(end, (at / chunk_slots + 1) * chunk_slots);
      while (at < chunk_end) {
        Extent e;
        e.range = i;
        e.first = at;
        e.count = std::min(extent_slots, chunk_end - at);
        extents_.push_back(e);
        firsts_.push_back(at);
        max_span_ = std::max(max_span_, e.count);
        at += e.count;
      }
    }
  }
  in_use_.assign((size_t)std::max<int64_t>(0, num_slots), 0);
  state_.resize(ranges_.size());
  online_in_.assign(ranges_.size(), 0);
  used_in_.assign(ranges_.size(), 0);
  set_online({{0, num_slots}});
}

// ---------------------------------------------------------------- counts

int64_t Slots::online_count() const {
  int64_t n = 0;
  for (int64_t v : online_in_) n += v;
  return n;
}

int64_t Slots::used_count() const {
  int64_t n = 0;
  for (int64_t v : used_in_) n += v;
  return n;
}

size_t Slots::extent_of(int64_t slot) const {
  auto after = std::upper_bound(firsts_.begin(), firsts_.end(), slot);
  return after == firsts_.begin() ? 0 : (size_t)(after - firsts_.begin() - 1);
}

int64_t Slots::span_at(int64_t slot) const {
  if (slot < 0 || slot >= num_slots_ || extents_.empty()) return 0;
  return extents_[extent_of(slot)].span;
}

int64_t Slots::free_extent_slots() const {
  int64_t n = 0;
  for (const RangeState& r : state_)
    for (size_t e : r.free_extents) n += extents_[e].count;
  return n;
}

bool Slots::frees_run(const std::vector<Shard>& shards, int64_t span) const {
  std::vector<std::pair<size_t, int64_t>> within;  // (extent, runs of the block in it)
  for (const Shard& shard : shards) {
    if (shard.slot < 0) continue;
    size_t e = extent_of(shard.slot);
    if (extents_[e].span == span) return true;
    auto at = std::find_if(within.begin(), within.end(), [&](auto& w) { return w.first == e; });
    if (at == within.end()) within.push_back({e, 1});
    else at->second++;
  }
  for (auto [e, n] : within)
    if (extents_[e].used == n && extents_[e].count >= span) return true;
  return false;
}

bool Slots::starts_run(int64_t slot) const {
  if (slot < 0 || slot >= num_slots_ || extents_.empty()) return false;
  const Extent& e = extents_[extent_of(slot)];
  int64_t offset = slot - e.first;
  return e.span > 0 && offset % e.span == 0 && offset + e.span <= e.count;
}

bool Slots::in_use(int64_t slot) const { return starts_run(slot) && in_use_[(size_t)slot]; }

// ---------------------------------------------------------------- bring-up

void Slots::set_online(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  for (Extent& e : extents_) e.online = false;
  for (auto [first, count] : ranges)
    for (size_t e : extents_within(first, count)) extents_[e].online = true;
  online_in_.assign(ranges_.size(), 0);
  for (const Extent& e : extents_)
    if (e.online) online_in_[e.range] += e.count;
  reset({}, false);  // their records stay: a kept pool's are adopted once it is up
}

int64_t Slots::add_online(int64_t first, int64_t count, const Runs& held) {
  std::vector<Runs> held_by = by_extent(held);
  int64_t added = 0;
  for (size_t e : extents_within(first, count)) {
    Extent& extent = extents_[e];
    if (extent.online) continue;
    extent.online = true;
    online_in_[extent.range] += extent.count;
    added += extent.count;
    place(e, held_by[e], true);
    for (auto& run : held_by[e]) kept_waiting_ += run.second;
  }
  return added;
}

void Slots::keep_only(const Runs& used) { reset(used, true); }

void Slots::reset(const Runs& used, bool clear) {
  kept_waiting_ = 0;
  used_in_.assign(ranges_.size(), 0);
  for (RangeState& r : state_) {
    r.free_extents.clear();
    r.partial.clear();
  }
  std::vector<Runs> used_by = by_extent(used);
  // Pushed highest first: the lowest is taken first.
  for (size_t e = extents_.size(); e-- > 0;) {
    Extent& extent = extents_[e];
    extent.span = extent.used = 0;
    extent.runs.clear();
    if (extent.online) {
      place(e, used_by[e], clear);  // which sets its runs' in-use flags
    } else {
      std::fill(in_use_.begin() + extent.first, in_use_.begin() + extent.first + extent.count, 0);
    }
  }
}

// ---------------------------------------------------------------- runs

int64_t Slots::allocate(int32_t node, int64_t span) {
  if (span < 1 || span > max_span_) return -1;
  std::vector<size_t> order, others;
  for (size_t i = 0; i < ranges_.size(); i++) (node >= 0 && ranges_[i].node == node ? order : others).push_back(i);
  // Then the range with the most free slots (the first of equals).
  std::stable_sort(others.begin(), others.end(), [&](size_t a, size_t b) { return free_in(a) > free_in(b); });
  order.insert(order.end(), others.begin(), others.end());
  for (size_t i : order) {
    int64_t slot = take(i, span);
    if (slot >= 0) return slot;
  }
  return -1;
}

void Slots::release(int64_t slot) {
  if (!in_use(slot)) throw std::invalid_argument(format("slot %lld does not start a run in use", (long long)slot));
  in_use_[(size_t)slot] = 0;
  // A block dropped (evicted, cleared) must not come back at a restart, nor a
  // seal still on its way write its record (seal.cpp checks the epoch).
  if (records_) std::memset(record(slot), 0, RECORD_BYTES);
  epochs_[slot].fetch_add(1, std::memory_order_acq_rel);
  size_t e = extent_of(slot);
  Extent& extent = extents_[e];
  extent.used--;
  used_in_[extent.range] -= extent.span;
  if (extent.used == 0) {  // free again, for any span
    unlist_partial(e);
    extent.span = 0;
    extent.runs.clear();
    state_[extent.range].free_extents.push_back(e);
    return;
  }
  extent.runs.push_back(slot);
  if (extent.runs.size() == 1) list_partial(e);
}

int64_t Slots::take(size_t i, int64_t span) {
  RangeState& r = state_[i];
  size_t e;
  auto partial = r.partial.find(span);
  if (partial != r.partial.end() && !partial->second.empty()) {
    e = partial->second.begin()->second;
  } else {
    // The top free extent, unless it is too short (a chunk's tail).
    auto& stack = r.free_extents;
    size_t at = stack.size();
    while (at > 0 && extents_[stack[at - 1]].count < span) at--;
    if (at == 0) return -1;
    e = stack[at - 1];
    stack.erase(stack.begin() + (ptrdiff_t)(at - 1));
    Extent& extent = extents_[e];
    extent.span = span;
    extent.runs.clear();
    for (int64_t k = extent.count / span - 1; k >= 0; k--) extent.runs.push_back(extent.first + k * span);
    list_partial(e);
  }
  Extent& extent = extents_[e];
  int64_t slot = extent.runs.back();
  extent.runs.pop_back();
  in_use_[(size_t)slot] = 1;
  extent.used++;
  used_in_[i] += span;
  if (extent.runs.empty()) unlist_partial(e);
  return slot;
}

void Slots::list_partial(size_t e) {
  Extent& extent = extents_[e];
  extent.listed = ++listed_;
  state_[extent.range].partial[extent.span].insert({extent.listed, e});
}

void Slots::unlist_partial(size_t e) {
  Extent& extent = extents_[e];
  auto found = state_[extent.range].partial.find(extent.span);
  if (found != state_[extent.range].partial.end()) found->second.erase({extent.listed, e});
}

void Slots::place(size_t e, const Runs& runs, bool clear) {
  Extent& extent = extents_[e];
  size_t i = extent.range;
  extent.runs.clear();
  std::fill(in_use_.begin() + extent.first, in_use_.begin() + extent.first + extent.count, 0);
  for (auto& run : runs) in_use_[(size_t)run.first] = 1;
  if (runs.empty()) {
    extent.span = extent.used = 0;
    state_[i].free_extents.push_back(e);
  } else {
    int64_t span = runs.front().second;
    extent.span = span;
    extent.used = (int64_t)runs.size();
    used_in_[i] += span * (int64_t)runs.size();
    std::set<int64_t> starts;
    for (auto& run : runs) starts.insert(run.first);
    for (int64_t s = extent.first + (extent.count / span - 1) * span; s >= extent.first; s -= span)
      if (!starts.count(s)) extent.runs.push_back(s);
    if (!extent.runs.empty()) list_partial(e);
  }
  if (!clear || !records_) return;
  // The slots outside the runs in use: a restart must find them empty.
  std::vector<bool> taken((size_t)extent.count, false);
  for (auto& run : runs)
    for (int64_t k = 0; k < run.second && run.first - extent.first + k < extent.count; k++)
      taken[(size_t)(run.first - extent.first + k)] = true;
  for (int64_t k = 0; k < extent.count; k++)
    if (!taken[(size_t)k]) std::memset(record(extent.first + k), 0, RECORD_BYTES);
}

std::vector<Slots::Runs> Slots::by_extent(const Runs& runs) const {
  std::vector<Runs> by(extents_.size());
  for (auto& run : runs)
    if (run.first >= 0 && run.first < num_slots_ && run.second >= 1) by[extent_of(run.first)].push_back(run);
  return by;
}

std::vector<size_t> Slots::extents_within(int64_t first, int64_t count) const {
  std::vector<size_t> out;
  if (extents_.empty()) return out;
  for (size_t e = extent_of(std::max<int64_t>(first, 0));
       e < extents_.size() && extents_[e].first + extents_[e].count <= first + count; e++)
    if (extents_[e].first >= first) out.push_back(e);
  return out;
}

}  // namespace kvd
