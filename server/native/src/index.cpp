// The block index: which keys are stored where, who pins them, what to evict
// (port of server/core/index.py, whose docstring states the rules). Every
// derived count (slots and ready blocks per namespace, slots held and being
// stored per scope, the pinned blocks) changes in count() and pin()/unpin()
// alone; verify() recomputes them all.
#include "index.h"

#include <chrono>

#define XXH_INLINE_ALL
#include "../third_party/xxhash/xxhash.h"

namespace kvd {

// room.py NO_ROOM_S.
constexpr int64_t NO_ROOM_NS = 1'000'000'000;

size_t KeyHash::operator()(const IndexKey& k) const {
  return (size_t)XXH3_64bits_withSeed(k.key.b, KEY_BYTES, seed ^ ((uint64_t)k.ns * 0x9E3779B97F4A7C15ull));
}

Index::Index(Slots& slots, IndexHooks& hooks, bool arc, int64_t capacity, uint64_t seed)
    : slots_(slots), hooks_(hooks), arc_(arc), capacity_(capacity), hash_{seed}, map_(1024, hash_) {}

// ---------------------------------------------------------------- scopes and namespaces

uint32_t Index::scope(const std::string& name, int64_t quota) {
  auto found = scope_ids_.find(name);
  if (found != scope_ids_.end()) return found->second;
  uint32_t id = (uint32_t)scopes_.size();
  scopes_.emplace_back();
  scopes_.back().name = name;
  scopes_.back().quota = quota;
  scope_ids_[name] = id;
  return id;
}

Namespace& Index::add_namespace(uint32_t id, uint32_t scope, uint16_t tp, const std::string& name) {
  Namespace& ns = namespaces_[id];
  ns.id = id;
  ns.scope = scope;
  ns.tp = tp;
  ns.name = name;
  ns.live = true;
  return ns;
}

Namespace* Index::ns(uint32_t id) {
  auto found = namespaces_.find(id);
  return found == namespaces_.end() ? nullptr : &found->second;
}

void Index::remove_namespace(uint32_t id) { namespaces_.erase(id); }

Policy& Index::policy(uint32_t scope) {
  Scope& s = scopes_[scope];
  if (!s.policy) s.policy.reset(new Policy(arc_, (double)std::max<int64_t>(1, s.quota >= 0 ? s.quota : capacity_), hash_));
  return *s.policy;
}

// ---------------------------------------------------------------- entries

uint32_t Index::find(const IndexKey& ik) const {
  auto found = map_.find(ik);
  return found == map_.end() ? NIL : found->second;
}

bool Index::contains(uint32_t ns, const Key& key) const { return find(IndexKey{ns, key}) != NIL; }

uint32_t Index::create(Namespace& ns, const Key& key) {
  uint32_t b;
  if (!free_entries_.empty()) {
    b = free_entries_.back();
    free_entries_.pop_back();
  } else {
    b = (uint32_t)blocks_.size();
    blocks_.emplace_back();
  }
  Block& block = blocks_[b];
  uint32_t gen = block.gen + 1;
  block = Block();
  block.gen = gen;
  block.ik = IndexKey{ns.id, key};
  block.scope = ns.scope;
  block.tp = ns.tp;
  block.shards.assign(ns.tp, Shard());
  return b;  // not in the map until the caller keeps it
}

void Index::erase(uint32_t b) {
  Block& block = blocks_[b];
  if (block.live) map_.erase(block.ik);
  block.live = false;
  block.shards.clear();
  free_entries_.push_back(b);
}

Block* Index::by_handle(uint64_t handle) {
  uint32_t b = (uint32_t)handle, gen = (uint32_t)(handle >> 32);
  if (b >= blocks_.size() || blocks_[b].gen != gen || !blocks_[b].live) return nullptr;
  return &blocks_[b];
}

// ---------------------------------------------------------------- counts

void Index::count(Namespace& ns, int64_t held, int64_t storing, int64_t ready) {
  Scope& scope = scopes_[ns.scope];
  if (held) {
    ns.used_slots += held;
    if (!scope.in_held) {
      scope.in_held = true;
      held_order_.push_back(ns.scope);
    }
    scope.held += held;
  }
  if (storing) scope.storing += storing;
  if (ready) ns.ready_blocks += ready;
}

void Index::pin(uint32_t b) {
  blocks_[b].pins++;
  pinned_.insert(b);
}

void Index::unpin(uint32_t b) {
  if (--blocks_[b].pins == 0) pinned_.erase(b);
}

std::vector<std::pair<uint32_t, int64_t>> Index::held_by_scope() const {
  std::vector<std::pair<uint32_t, int64_t>> used;
  for (uint32_t s : held_order_) used.push_back({s, scopes_[s].held});
  return used;
}

int64_t Index::held_span(const Block& block) const {
  int64_t n = 0;
  for (const Shard& shard : block.shards)
    if (shard.slot >= 0) n += slots_.span_at(shard.slot);
  return n;
}

int64_t Index::pinned_slots() const {
  int64_t n = 0;
  for (uint32_t b : pinned_) n += held_span(blocks_[b]);
  return n;
}

size_t Index::eviction_size() const {
  size_t n = 0;
  for (const Scope& s : scopes_)
    if (s.policy) n += s.policy->size();
  return n;
}

// ---------------------------------------------------------------- stores

Index::Reservation Index::reserve_store(Namespace& ns, uint32_t rank, const Key* keys, size_t n, uint64_t job,
                                        int32_t node, int64_t span) {
  Reservation r;
  Policy& order = policy(ns.scope);
  int64_t room = storing_room(ns.scope);
  uint64_t bit = 1ull << rank;
  for (size_t position = 0; position < n; position++) {
    IndexKey ik{ns.id, keys[position]};
    uint32_t b = find(ik);
    if (b != NIL) {
      Block& block = blocks_[b];
      if (block.ready || (block.committed & bit) || (block.writers & bit)) {
        r.already++;
        if (block.ready) Eviction::touch(*this, order, b);
        continue;
      }
    }
    if (room < span) {
      r.not_stored = (uint32_t)(n - position);
      return r;
    }
    bool created = b == NIL;
    if (created) b = create(ns, keys[position]);
    pin(b);  // before making room, so that eviction cannot take it
    int64_t slot = allocate_slot(b, ns.scope, node, span);
    if (slot < 0) {
      unpin(b);
      if (created) erase(b);
      r.not_stored = (uint32_t)(n - position);
      return r;
    }
    room -= span;
    Block& block = blocks_[b];
    if (created) {
      block.live = true;
      map_[ik] = b;
    }
    block.shards[rank].slot = slot;
    bool starts_storing = block.writers == 0;
    block.writers |= bit;
    block.shards[rank].writer = job;
    if (starts_storing) hooks_.changed(ns, block.ik.key, Change::STORING);
    count(ns, span, span, 0);
    r.writes.push_back({(uint32_t)position, b});
  }
  return r;
}

void Index::finish_stores(const std::vector<uint32_t>& blocks, uint32_t rank, bool ok, uint64_t length,
                          const std::vector<uint64_t>* hashes) {
  for (uint32_t b : blocks) finish_shard(b, rank, ok);
  if (ok && !blocks.empty()) hooks_.committed(*ns(blocks_[blocks[0]].ik.ns), rank, blocks, length, hashes);
}

void Index::finish_shard(uint32_t b, uint32_t rank, bool ok) {
  Block& block = blocks_[b];
  Namespace& ns = *this->ns(block.ik.ns);
  uint64_t bit = 1ull << rank;
  block.writers &= ~bit;
  unpin(b);
  count(ns, 0, -slots_.span_at(block.shards[rank].slot), 0);
  if (!ok) {
    if (!block.writers) hooks_.changed(ns, block.ik.key, Change::DROPPED);
    drop_shard(b, rank);
    return;
  }
  if (!block.committed) Eviction::insert(*this, policy(block.scope), b);
  block.committed |= bit;
  if ((uint32_t)__builtin_popcountll(block.committed) == block.tp) {
    block.ready = true;
    count(ns, 0, 0, 1);
    hooks_.changed(ns, block.ik.key, Change::READY);
  } else if (!block.writers) {
    hooks_.changed(ns, block.ik.key, Change::DROPPED);  // waits for other ranks, no store in flight
  }
}

void Index::drop_shard(uint32_t b, uint32_t rank) {
  Block& block = blocks_[b];
  int64_t slot = block.shards[rank].slot;
  block.shards[rank].slot = -1;
  if (slot >= 0) {
    count(*ns(block.ik.ns), -slots_.span_at(slot), 0, 0);
    slots_.release(slot);
  }
  if (block.held_slots() == 0 && !block.writers && block.pins == 0) {
    Eviction::remove(*this, policy(block.scope), b);
    erase(b);
  }
}

// ---------------------------------------------------------------- loads

std::vector<uint32_t> Index::reserve_load(Namespace& ns, const Key* keys, size_t n, uint32_t rank,
                                          uint64_t block_bytes) {
  std::vector<uint32_t> out;
  out.reserve(n);
  for (size_t position = 0; position < n; position++) {
    uint32_t b = find(IndexKey{ns.id, keys[position]});
    if (b == NIL || !blocks_[b].ready) {
      static const char* hex = "0123456789abcdef";
      char prefix[17];
      for (int i = 0; i < 8; i++) {
        prefix[2 * i] = hex[keys[position].b[i] >> 4];
        prefix[2 * i + 1] = hex[keys[position].b[i] & 15];
      }
      prefix[16] = 0;
      throw Refusal{FAILED_PRECONDITION,
                    format("key %zu of %zu (%s...) is not stored in namespace %s (never stored, still being stored, "
                           "or evicted); look it up again",
                           position, n, prefix, ns.name.c_str())};
    }
    Block& block = blocks_[b];
    if (block.has_lengths && block.shards[rank].length != block_bytes) {
      uint64_t kept = block.shards[rank].length;
      if (block.pins == 0) {  // no worker of this layout can use it: it goes
        Eviction::remove(*this, policy(block.scope), b);
        Key key = block.ik.key;
        drop(b);
        hooks_.changed(ns, key, Change::DROPPED);
      }
      throw Refusal{FAILED_PRECONDITION,
                    format("key %zu of %zu was kept with %llu bytes for rank %u, and this worker's blocks have %llu: "
                           "the namespace's layout changed since it was stored",
                           position, n, (unsigned long long)kept, rank, (unsigned long long)block_bytes)};
    }
    out.push_back(b);
  }
  for (uint32_t b : out) {
    pin(b);
    blocks_[b].loading++;
  }
  return out;
}

uint32_t Index::take_promoted(const std::vector<uint32_t>& blocks) {
  uint32_t count = 0;
  for (uint32_t b : blocks) {
    if (blocks_[b].promoted) {
      blocks_[b].promoted = false;
      count++;
    }
  }
  return count;
}

void Index::finish_loads(const std::vector<uint32_t>& blocks) {
  for (uint32_t b : blocks) {
    blocks_[b].loading--;
    unpin(b);
    Eviction::touch(*this, policy(blocks_[b].scope), b);
  }
}

// ---------------------------------------------------------------- room

int64_t Index::allocate_slot(uint32_t incoming, uint32_t scope, int32_t node, int64_t span) {
  Scope& s = scopes_[scope];
  auto at_quota = [&] { return s.quota >= 0 && s.held + span > s.quota; };
  int64_t slot = at_quota() ? -1 : slots_.allocate(node, span);
  // A full pool (the steady state), or a scope at its quota: each new block
  // evicts, of the scope that shares.py says gives up a slot; when the oldest
  // block there frees no run of this span, one extent is cleared (room.py).
  const IndexKey incoming_key = blocks_[incoming].ik;
  while (slot < 0) {
    std::vector<uint32_t> order =
        Eviction::victims(scopes_, scope, held_by_scope(), (double)capacity_, (double)capacity_);
    uint32_t oldest = NIL;
    for (uint32_t victim_scope : order) {
      oldest = Eviction::oldest(*this, policy(victim_scope), victim_scope == scope ? &incoming_key : nullptr);
      if (oldest != NIL) break;
    }
    if (oldest == NIL) return -1;
    std::vector<uint32_t> going{oldest};
    if (!at_quota() && !slots_.frees_run(blocks_[oldest].shards, span)) {
      uint64_t pair = ((uint64_t)scope << 32) | (uint64_t)(uint32_t)span;
      int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch()).count();
      auto recent = no_room_until_.find(pair);
      if (recent != no_room_until_.end() && now < recent->second) return -1;
      going = room_for(oldest, span, order, scope, incoming_key);
      if (going.empty()) {
        if (no_room_until_.size() >= 4096)
          for (auto at = no_room_until_.begin(); at != no_room_until_.end();)
            at = at->second <= now ? no_room_until_.erase(at) : std::next(at);
        no_room_until_[pair] = now + NO_ROOM_NS;
        return -1;
      }
    }
    for (uint32_t b : going) evict(b);
    if (!at_quota()) slot = slots_.allocate(node, span);  // else the scope evicts its own until its quota has room
  }
  return slot;
}

std::vector<uint32_t> Index::room_for(uint32_t oldest, int64_t span, const std::vector<uint32_t>& order,
                                      uint32_t scope, const IndexKey& incoming) {
  std::vector<uint32_t> allowed = order;
  allowed.push_back(scope);
  std::vector<uint32_t> going = clearing(oldest, span, allowed);
  if (!going.empty()) return going;
  for (uint32_t s : order) {
    Policy& p = policy(s);
    for (uint8_t list : Eviction::lists(p, s == scope ? &incoming : nullptr)) {
      for (uint32_t b = (list == 2 ? p.t2 : p.t1).head; b != NIL; b = blocks_[b].next) {
        const Block& block = blocks_[b];
        if (block.ready && !block.pins && slots_.frees_run(block.shards, span)) return {b};
      }
    }
  }
  return {};
}

std::vector<uint32_t> Index::clearing(uint32_t oldest, int64_t span, const std::vector<uint32_t>& allowed) {
  size_t n = slots_.extents();
  std::vector<int64_t> held(n, 0);
  std::vector<uint8_t> barred(n, 0);
  for (const Block& block : blocks_) {  // free entries have no shards
    bool may_go = block.ready && block.pins == 0 &&
                  std::find(allowed.begin(), allowed.end(), block.scope) != allowed.end();
    for (const Shard& shard : block.shards) {
      if (shard.slot < 0) continue;
      size_t e = slots_.extent_of(shard.slot);
      held[e]++;
      barred[e] |= !may_go;
    }
  }
  auto clearable = [&](size_t e) { return held[e] > 0 && !barred[e] && slots_.can_clear(e, span, held[e]); };
  size_t choice = n;  // none
  for (const Shard& shard : blocks_[oldest].shards) {
    if (shard.slot >= 0 && clearable(slots_.extent_of(shard.slot))) {
      choice = slots_.extent_of(shard.slot);
      break;
    }
  }
  if (choice == n)
    for (size_t e = 0; e < n; e++)
      if (clearable(e) && (choice == n || held[e] < held[choice])) choice = e;
  if (choice == n) return {};
  auto [first, end] = slots_.bounds(choice);
  std::vector<std::pair<int64_t, uint32_t>> going;  // (its lowest slot in the extent, block)
  for (uint32_t b = 0; b < blocks_.size(); b++) {
    int64_t lowest = end;
    for (const Shard& shard : blocks_[b].shards)
      if (shard.slot >= first && shard.slot < end) lowest = std::min(lowest, shard.slot);
    if (lowest < end) going.push_back({lowest, b});
  }
  std::sort(going.begin(), going.end());
  std::vector<uint32_t> out;
  for (auto [lowest, b] : going) out.push_back(b);
  return out;
}

void Index::evict(uint32_t b) {
  Block& block = blocks_[b];
  Eviction::evict(*this, policy(block.scope), b);
  Namespace& ns = *this->ns(block.ik.ns);
  bool was_ready = block.ready;
  Key key = block.ik.key;
  drop(b);
  hooks_.evicted(ns);
  hooks_.changed(ns, key, was_ready ? Change::EVICTED : Change::DROPPED);
}

int64_t Index::storing_room(uint32_t scope) {
  size_t active = 0;
  bool listed = false;
  for (uint32_t s : held_order_) {
    active += scopes_[s].held > 0 || s == scope;
    listed |= s == scope;
  }
  if (!listed) active++;
  return (int64_t)Eviction::share(scopes_[scope], (double)capacity_, active) - scopes_[scope].storing;
}

void Index::drop(uint32_t b) {
  // An unpinned block out, whatever its shards; the caller took it out of its order.
  Block& block = blocks_[b];
  Namespace& ns = *this->ns(block.ik.ns);
  int64_t held = 0;
  for (Shard& shard : block.shards) {
    if (shard.slot >= 0) {
      held += slots_.span_at(shard.slot);
      slots_.release(shard.slot);
      shard.slot = -1;
    }
  }
  count(ns, -held, 0, -(int64_t)block.ready);
  erase(b);
}

}  // namespace kvd
