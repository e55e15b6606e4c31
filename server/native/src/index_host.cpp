// What the control plane and the tiers ask of the block index (port of
// server/core/index.py's lookup, the TierHost methods, restore, clear), and
// its self-check (index_check.py).
#include "index.h"

namespace kvd {

// ---------------------------------------------------------------- lookups

Index::Next Index::lookup(const Namespace& ns, const Key* keys, size_t n, size_t start, bool count_ready,
                          uint32_t* ready, uint32_t* loading, uint32_t* storing, size_t* at) {
  size_t i = start;
  if (count_ready) {
    for (; i < n; i++) {
      uint32_t b = find(IndexKey{ns.id, keys[i]});
      if (b == NIL || !blocks_[b].ready) break;
      (*ready)++;
      *loading += blocks_[b].loading > 0;
    }
  }
  for (; i < n; i++) {
    *at = i;
    uint32_t b = find(IndexKey{ns.id, keys[i]});
    if (b == NIL) return Next::ABSENT;
    if (blocks_[b].ready || !blocks_[b].writers) return Next::STOP;
    (*storing)++;
  }
  *at = n;
  return Next::END;
}

// ---------------------------------------------------------------- tiers

uint32_t Index::reserve_promotion(Namespace& ns, const Key& key, const std::vector<uint64_t>& lengths) {
  std::vector<int64_t> spans;
  int64_t total = 0;
  for (uint32_t rank = 0; rank < ns.tp; rank++) total += spans.emplace_back(slots_.span(lengths[rank]));
  if (storing_room(ns.scope) < total) return NIL;  // a tenant's share, as for its stores
  uint32_t b = create(ns, key);
  blocks_[b].has_lengths = true;
  for (uint32_t rank = 0; rank < ns.tp; rank++) blocks_[b].shards[rank].length = lengths[rank];
  for (uint32_t rank = 0; rank < ns.tp; rank++) {
    pin(b);  // before making room, so that eviction cannot take it
    int64_t slot = allocate_slot(b, ns.scope, -1, spans[rank]);
    if (slot < 0) {
      int64_t held = held_span(blocks_[b]);
      for (Shard& shard : blocks_[b].shards)
        if (shard.slot >= 0) slots_.release(shard.slot);
      count(ns, -held, -held, 0);
      for (uint32_t i = 0; i <= rank; i++) unpin(b);
      erase(b);
      return NIL;
    }
    blocks_[b].shards[rank].slot = slot;
    blocks_[b].shards[rank].writer = PROMOTION;
    blocks_[b].writers |= 1ull << rank;
    count(ns, spans[rank], spans[rank], 0);
  }
  blocks_[b].promoted = true;
  blocks_[b].live = true;
  map_[blocks_[b].ik] = b;
  hooks_.changed(ns, key, Change::STORING);
  return b;
}

void Index::finish_promotion(uint32_t b, bool ok) {
  for (uint32_t rank = 0, tp = blocks_[b].tp; rank < tp; rank++) finish_shard(b, rank, ok);
}

bool Index::restore(Namespace& ns, const Key& key, const std::vector<int64_t>& slots,
                    const std::vector<uint64_t>& lengths, bool oldest) {
  if (contains(ns.id, key)) {
    // Stored anew while its kept copy waited for its chunk: that one is served.
    for (int64_t slot : slots) slots_.release(slot);
    return false;
  }
  uint32_t b = create(ns, key);
  Block& block = blocks_[b];
  for (uint32_t rank = 0; rank < ns.tp; rank++) {
    block.shards[rank].slot = slots[rank];
    block.shards[rank].length = lengths[rank];
  }
  block.has_lengths = true;
  block.committed = ns.tp == 64 ? ~0ull : (1ull << ns.tp) - 1;
  block.ready = true;
  block.live = true;
  map_[block.ik] = b;
  count(ns, held_span(block), 0, 1);
  if (oldest) Eviction::insert_oldest(*this, policy(ns.scope), b);
  else Eviction::insert(*this, policy(ns.scope), b);
  hooks_.changed(ns, key, Change::READY);
  return true;
}

std::pair<uint64_t, uint64_t> Index::clear(const Namespace* ns) {
  uint64_t cleared = 0, pinned = 0;
  std::vector<uint32_t> targets;
  for (uint32_t b = 0; b < blocks_.size(); b++)
    if (blocks_[b].live && (ns == nullptr || blocks_[b].ik.ns == ns->id)) targets.push_back(b);
  for (uint32_t b : targets) {
    Block& block = blocks_[b];
    if (block.pins) {
      pinned++;
      continue;
    }
    Eviction::remove(*this, policy(block.scope), b);
    Namespace& owner = *this->ns(block.ik.ns);
    Key key = block.ik.key;
    drop(b);
    hooks_.changed(owner, key, Change::DROPPED);
    cleared++;
  }
  return {cleared, pinned};
}

std::vector<Key> Index::keys_of(uint32_t ns, Which which) const {
  std::vector<Key> keys;
  for (const Block& block : blocks_) {
    if (!block.live || block.ik.ns != ns) continue;
    bool take = which == Which::ALL || (which == Which::READY && block.ready) ||
                (which == Which::STORING && !block.ready && block.writers);
    if (take) keys.push_back(block.ik.key);
  }
  return keys;
}

// ---------------------------------------------------------------- checking

std::string Index::verify() const {
  std::unordered_map<uint32_t, int64_t> used, ready;
  std::vector<int64_t> held(scopes_.size()), storing(scopes_.size());
  size_t live = 0, in_order = 0;
  int64_t slots = 0;
  for (uint32_t b = 0; b < blocks_.size(); b++) {
    const Block& block = blocks_[b];
    if (!block.live) continue;
    live++;
    in_order += block.list != 0;
    int64_t n = held_span(block);
    slots += n;
    used[block.ik.ns] += n;
    ready[block.ik.ns] += block.ready;
    held[block.scope] += n;
    for (uint32_t rank = 0; rank < block.tp; rank++)
      if ((block.writers >> rank) & 1) storing[block.scope] += slots_.span_at(block.shards[rank].slot);
    if ((block.pins > 0) != (pinned_.count(b) > 0)) return format("block %u: pins %u but pinned set disagrees", b, block.pins);
    if (block.ready && (uint32_t)__builtin_popcountll(block.committed) != block.tp)
      return format("block %u is ready with %d of %u ranks committed", b, __builtin_popcountll(block.committed),
                    block.tp);
    if (map_.find(block.ik) == map_.end() || map_.at(block.ik) != b) return format("block %u is not in the map", b);
  }
  if (live != map_.size()) return format("%zu live blocks but %zu in the map", live, map_.size());
  for (const auto& entry : namespaces_) {
    const Namespace& ns = entry.second;
    if (ns.used_slots != used[ns.id]) return format("namespace %u counts %lld slots, holds %lld", ns.id, (long long)ns.used_slots, (long long)used[ns.id]);
    if (ns.ready_blocks != ready[ns.id]) return format("namespace %u counts %lld ready blocks, holds %lld", ns.id, (long long)ns.ready_blocks, (long long)ready[ns.id]);
  }
  for (size_t s = 0; s < scopes_.size(); s++) {
    if (scopes_[s].held != held[s]) return format("scope %zu counts %lld slots held, holds %lld", s, (long long)scopes_[s].held, (long long)held[s]);
    if (scopes_[s].storing != storing[s]) return format("scope %zu counts %lld slots being stored, %lld are", s, (long long)scopes_[s].storing, (long long)storing[s]);
  }
  if (slots + slots_.kept_waiting() != slots_.online() - slots_.free())
    return format("blocks hold %lld slots and %lld wait for adoption, the pool has %lld used", (long long)slots,
                  (long long)slots_.kept_waiting(), (long long)(slots_.online() - slots_.free()));
  if (eviction_size() != in_order) return format("eviction orders hold %zu blocks, %zu are listed", eviction_size(), in_order);
  return "";
}

}  // namespace kvd
