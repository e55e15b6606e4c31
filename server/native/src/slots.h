// The pool's free space as runs of slots (port of server/host/free_runs.py,
// whose docstring says why), and what releasing a run does to the pool file
// (host/pool.py HostPool.release): its record cleared, its epoch bumped.
#pragma once

#include <set>

#include "lane.h"

namespace kvd {

// A shard of L bytes takes a run of ceil(L / slot bytes) consecutive slots.
// The pool is cut into extents (at most extent_slots, never across a NUMA
// range or a registration chunk); an extent holds runs of one span at a time,
// at its first slot, first + span, ...; with none in use it is free again.
class Slots {
 public:
  struct Range {
    int32_t node;  // -1: the whole pool, not carved
    int64_t first;
    int64_t count;
  };
  using Runs = std::vector<std::pair<int64_t, int64_t>>;  // (first slot, span)

  Slots(int64_t num_slots, std::vector<Range> ranges, int64_t chunk_slots, int64_t extent_slots, uint64_t slot_bytes,
        uint8_t* records);
  // The slots a shard of `nbytes` takes.
  int64_t span(uint64_t nbytes) const {
    return std::max<int64_t>(1, (int64_t)((nbytes + slot_bytes_ - 1) / slot_bytes_));
  }
  // The first slot of a free run of `span`, of `node`'s range while it has
  // room; -1 when no range has.
  int64_t allocate(int32_t node, int64_t span);
  // `slot` must start a run in use; std::invalid_argument otherwise.
  void release(int64_t slot);
  // Whether `slot` is a run's first slot in an extent of runs, and whether
  // that run is in use (a block's, or held for a kept one).
  bool starts_run(int64_t slot) const;
  bool in_use(int64_t slot) const;
  // The span of `slot`'s extent's runs (0: a free extent, or out of the pool).
  int64_t span_at(int64_t slot) const;
  int64_t max_span() const { return max_span_; }
  // For room.py's choice (index.cpp clearing): the extents, and the one of `slot`.
  size_t extents() const { return extents_.size(); }
  size_t extent_of(int64_t slot) const;
  std::pair<int64_t, int64_t> bounds(size_t e) const { return {extents_[e].first, extents_[e].first + extents_[e].count}; }
  // Whether releasing a block's runs (its shards' slots, -1: none) frees a run
  // of `span` (free_runs.py frees_run).
  bool frees_run(const std::vector<Shard>& shards, int64_t span) const;
  // Whether extent `e` is free once `runs` runs of it go and then fits a run of `span`.
  bool can_clear(size_t e, int64_t span, int64_t runs) const {
    const Extent& x = extents_[e];
    return x.online && x.count >= span && x.used == runs;
  }
  // After adoption: every online extent free but the runs `used` (which
  // free_runs.py fits() accepted), the records of the other slots cleared.
  void keep_only(const Runs& used);
  // While the pool comes up (host/bring_up.py): only the extents inside these
  // [first, first + count) ranges are online, all free.
  void set_online(const std::vector<std::pair<int64_t, int64_t>>& ranges);
  // The extents inside [first, first + count) come online, free (their
  // records cleared) but the runs `held` (kept blocks waiting for their other
  // chunks: taken, records kept); returns how many slots came online.
  int64_t add_online(int64_t first, int64_t count, const Runs& held);

  int64_t free() const { return online_count() - used_count(); }
  // Slots of the online extents no run holds: room for a block of any size.
  int64_t free_extent_slots() const;
  int64_t free_in(size_t range) const { return online_in_[range] - used_in_[range]; }
  int64_t online() const { return online_count(); }
  int64_t online_in(size_t range) const { return online_in_[range]; }
  // Slots of runs taken for kept blocks that wait for their other chunks (no block holds them yet).
  int64_t kept_waiting() const { return kept_waiting_; }
  void set_kept_waiting(int64_t n) { kept_waiting_ = n; }
  void no_longer_waiting(int64_t n) { kept_waiting_ -= n; }
  int64_t num_slots() const { return num_slots_; }
  const std::vector<Range>& ranges() const { return ranges_; }
  uint64_t epoch(int64_t slot) const { return epochs_[slot].load(std::memory_order_acquire); }
  uint8_t* record(int64_t slot) const { return records_ ? records_ + slot * RECORD_BYTES : nullptr; }

 private:
  struct Extent {
    size_t range;
    int64_t first, count;
    int64_t span = 0;           // 0: free
    std::vector<int64_t> runs;  // free runs of its span, a stack: lowest on top
    int64_t used = 0;           // runs in use (a block's, or held for a kept block)
    bool online = false;
    uint64_t listed = 0;        // when it joined its range's partial set (insertion order)
  };
  struct RangeState {
    std::vector<size_t> free_extents;  // a stack: lowest on top
    // span -> extents of it with a free run, oldest listed first (free_runs.py's dict order).
    std::unordered_map<int64_t, std::set<std::pair<uint64_t, size_t>>> partial;
  };

  // Every online extent free but the runs `used`.
  void reset(const Runs& used, bool clear);
  int64_t online_count() const;
  int64_t used_count() const;
  int64_t take(size_t range, int64_t span);
  void list_partial(size_t e);
  void unlist_partial(size_t e);
  // Extent `e` (online) with `runs` in use (free when there are none); clears
  // the records of its other slots where `clear`.
  void place(size_t e, const Runs& runs, bool clear);
  std::vector<size_t> extents_within(int64_t first, int64_t count) const;
  std::vector<Runs> by_extent(const Runs& runs) const;

  int64_t num_slots_;
  std::vector<Range> ranges_;
  uint64_t slot_bytes_;
  int64_t max_span_ = 0;
  std::vector<Extent> extents_;
  std::vector<int64_t> firsts_;  // extents' first slots, for extent_of
  std::vector<RangeState> state_;
  std::vector<int64_t> online_in_;
  std::vector<int64_t> used_in_;
  std::vector<uint8_t> in_use_;  // per slot: it starts a run in use
  uint64_t listed_ = 0;
  int64_t kept_waiting_ = 0;
  uint8_t* records_;
  std::unique_ptr<std::atomic<uint64_t>[]> epochs_;
};

}  // namespace kvd
