// The block index (port of server/core/index.py), its eviction orders
// (eviction.py, shares.py); the pool's runs of slots are slots.h's.
#pragma once

#include "slots.h"
#include "../third_party/unordered_dense/unordered_dense.h"

namespace kvd {

// What the index tells the rest of the lane.
class IndexHooks {
 public:
  virtual ~IndexHooks() = default;
  virtual void changed(const Namespace& ns, const Key& key, Change state) = 0;
  virtual void evicted(Namespace& ns) = 0;
  // Rank `rank` shards of `blocks` (of `length` bytes) were committed; `hashes`:
  // their bytes' hashes where the GPU computed them (host/shard_hash.py), else null.
  virtual void committed(Namespace& ns, uint32_t rank, const std::vector<uint32_t>& blocks, uint64_t length,
                         const std::vector<uint64_t>* hashes) = 0;
};

class Index {
 public:
  Index(Slots& slots, IndexHooks& hooks, bool arc, int64_t capacity, uint64_t seed);

  // ------------------------------------------------ scopes and namespaces
  uint32_t scope(const std::string& name, int64_t quota);
  Namespace& add_namespace(uint32_t id, uint32_t scope, uint16_t tp, const std::string& name);
  Namespace* ns(uint32_t id);
  void remove_namespace(uint32_t id);

  // ------------------------------------------------ stores
  struct Reservation {
    std::vector<std::pair<uint32_t, uint32_t>> writes;  // (position in the request, block)
    uint32_t already = 0;
    uint32_t not_stored = 0;
  };
  // Runs of `span` slots for the shards `keys` still need, on NUMA `node` first (the worker's).
  Reservation reserve_store(Namespace& ns, uint32_t rank, const Key* keys, size_t n, uint64_t job, int32_t node,
                            int64_t span);
  void finish_stores(const std::vector<uint32_t>& blocks, uint32_t rank, bool ok, uint64_t length,
                     const std::vector<uint64_t>* hashes = nullptr);

  // ------------------------------------------------ loads
  std::vector<uint32_t> reserve_load(Namespace& ns, const Key* keys, size_t n, uint32_t rank, uint64_t block_bytes);
  uint32_t take_promoted(const std::vector<uint32_t>& blocks);
  void finish_loads(const std::vector<uint32_t>& blocks);

  // ------------------------------------------------ lookups (Python adds the tiers' part)
  enum class Next : uint8_t { END = 0, ABSENT = 1, STORING = 2, STOP = 3 };
  // From keys[start]: with `count_ready`, the ready prefix (and how many of it
  // are being loaded); then blocks being stored, until one that is absent
  // (Python asks the tiers) or neither.
  Next lookup(const Namespace& ns, const Key* keys, size_t n, size_t start, bool count_ready, uint32_t* ready,
              uint32_t* loading, uint32_t* storing, size_t* at);
  bool contains(uint32_t ns, const Key& key) const;

  // ------------------------------------------------ for the tiers (core/tiers.py TierHost)
  uint64_t handle(uint32_t b) const { return ((uint64_t)blocks_[b].gen << 32) | b; }
  Block* by_handle(uint64_t handle);
  void hold(uint32_t b) { pin(b); }
  void let_go(uint32_t b) { unpin(b); }
  // Slots for every rank of a block a tier fills, pinned; NIL when none can be had.
  uint32_t reserve_promotion(Namespace& ns, const Key& key, const std::vector<uint64_t>& lengths);
  void finish_promotion(uint32_t b, bool ok);
  // A ready block adopted from the kept pool, its slots taken already.
  // A kept block adopted with its slots taken; false (its slots freed) when
  // the index holds the key already.
  // `oldest`: at the old end of the eviction order (a kept block adopted late).
  bool restore(Namespace& ns, const Key& key, const std::vector<int64_t>& slots, const std::vector<uint64_t>& lengths,
               bool oldest = false);
  // Drops every unpinned block of `ns` (every namespace: nullptr): (dropped, kept pinned).
  std::pair<uint64_t, uint64_t> clear(const Namespace* ns);
  // Keys of `ns`: ready ones, being stored ones, or all.
  enum class Which : uint8_t { READY = 0, STORING = 1, ALL = 2 };
  std::vector<Key> keys_of(uint32_t ns, Which which) const;

  // ------------------------------------------------ counts
  int64_t pinned_slots() const;
  size_t eviction_size() const;
  // Recomputes every derived count (index_check.py); the first difference, or "".
  std::string verify() const;

  Block& block(uint32_t b) { return blocks_[b]; }
  const std::unordered_map<uint32_t, Namespace>& namespaces() const { return namespaces_; }

 private:
  friend class Eviction;
  uint32_t find(const IndexKey& ik) const;
  uint32_t create(Namespace& ns, const Key& key);
  void erase(uint32_t b);
  void count(Namespace& ns, int64_t held, int64_t storing, int64_t ready);
  void pin(uint32_t b);
  void unpin(uint32_t b);
  int64_t allocate_slot(uint32_t incoming, uint32_t scope, int32_t node, int64_t span);
  // The blocks to evict for a run of `span` when the policy's oldest frees
  // none (core/room.py says which); empty when nothing can make room.
  std::vector<uint32_t> room_for(uint32_t oldest, int64_t span, const std::vector<uint32_t>& order, uint32_t scope,
                                 const IndexKey& incoming);
  std::vector<uint32_t> clearing(uint32_t oldest, int64_t span, const std::vector<uint32_t>& allowed);
  void evict(uint32_t b);
  // The slots of a block's runs (every count of slots counts runs' slots).
  int64_t held_span(const Block& block) const;
  int64_t storing_room(uint32_t scope);
  void finish_shard(uint32_t b, uint32_t rank, bool ok);
  void drop_shard(uint32_t b, uint32_t rank);
  void drop(uint32_t b);
  Policy& policy(uint32_t scope);
  std::vector<std::pair<uint32_t, int64_t>> held_by_scope() const;

  Slots& slots_;
  IndexHooks& hooks_;
  bool arc_;
  int64_t capacity_;
  KeyHash hash_;
  std::vector<Block> blocks_;
  std::vector<uint32_t> free_entries_;
  // Open addressing: a lookup touches a bucket and the entry beside it, not a
  // chain of separately allocated nodes (a store looks up every block).
  ankerl::unordered_dense::map<IndexKey, uint32_t, KeyHash> map_;
  ankerl::unordered_dense::set<uint32_t> pinned_;
  std::vector<Scope> scopes_;
  std::unordered_map<std::string, uint32_t> scope_ids_;
  std::vector<uint32_t> held_order_;  // scopes in the order they first held slots
  // (scope << 32 | span) whose search for room found none, until when (steady ns): room.py NoRoom.
  std::unordered_map<uint64_t, int64_t> no_room_until_;
  std::unordered_map<uint32_t, Namespace> namespaces_;
};

// One scope's eviction order, and which scope gives up a slot when the pool
// is full (eviction.py, shares.py): over the index's blocks.
class Eviction {
 public:
  static void insert(Index& index, Policy& policy, uint32_t b);
  // At the old end (eviction.py insert_oldest): a kept block adopted late.
  static void insert_oldest(Index& index, Policy& policy, uint32_t b);
  static void touch(Index& index, Policy& policy, uint32_t b);
  static void remove(Index& index, Policy& policy, uint32_t b);
  // The block the policy would evict, left in place; NIL when every one is pinned.
  static uint32_t oldest(Index& index, Policy& policy, const IndexKey* incoming);
  // The lists (1: T1, 2: T2) in the order oldest() looks in them.
  static std::vector<uint8_t> lists(const Policy& policy, const IndexKey* incoming);
  // Out of the order (under ARC, remembered in the ghost list beside its list).
  static void evict(Index& index, Policy& policy, uint32_t b);
  // oldest(), evicted.
  static uint32_t victim(Index& index, Policy& policy, const IndexKey* incoming);
  // The scopes to take room from, in turn (shares.py ScopedEviction.victims).
  static std::vector<uint32_t> victims(const std::vector<Scope>& scopes, uint32_t incoming,
                                       const std::vector<std::pair<uint32_t, int64_t>>& used, double capacity,
                                       double total);
  static double share(const Scope& scope, double capacity, size_t active);
};

}  // namespace kvd
