// Which ready block to drop when the pool is full, and from which scope (port of
// server/core/eviction.py and shares.py). A policy orders blocks; the index
// tells which may go (no pins) and frees their slots.
#include <algorithm>

#include "index.h"

namespace kvd {

void Ghosts::add(const IndexKey& k) {
  auto found = where.find(k);
  if (found != where.end()) order.erase(found->second);
  order.push_back(k);
  where[k] = std::prev(order.end());
}

void Ghosts::erase(const IndexKey& k) {
  auto found = where.find(k);
  if (found == where.end()) return;
  order.erase(found->second);
  where.erase(found);
}

void Ghosts::pop_oldest() {
  if (order.empty()) return;
  where.erase(order.front());
  order.pop_front();
}

namespace {

void unlink(Index& index, Order& order, uint32_t b) {
  Block& block = index.block(b);
  if (block.prev != NIL) index.block(block.prev).next = block.next;
  else order.head = block.next;
  if (block.next != NIL) index.block(block.next).prev = block.prev;
  else order.tail = block.prev;
  block.prev = block.next = NIL;
  block.list = 0;
  order.size--;
}

void push_back(Index& index, Order& order, uint32_t b, uint8_t list) {
  Block& block = index.block(b);
  block.prev = order.tail;
  block.next = NIL;
  if (order.tail != NIL) index.block(order.tail).next = b;
  else order.head = b;
  order.tail = b;
  block.list = list;
  order.size++;
}

void push_front(Index& index, Order& order, uint32_t b, uint8_t list) {
  Block& block = index.block(b);
  block.prev = NIL;
  block.next = order.head;
  if (order.head != NIL) index.block(order.head).prev = b;
  else order.tail = b;
  order.head = b;
  block.list = list;
  order.size++;
}

Order& list_of(Policy& policy, uint8_t list) { return list == 2 ? policy.t2 : policy.t1; }

// The oldest unpinned block, left in place. Pinned blocks passed over move to
// the recent end, as if used now (eviction.py _first says why).
uint32_t first(Index& index, Order& order, uint8_t list) {
  std::vector<uint32_t> passed;
  uint32_t found = NIL;
  for (uint32_t b = order.head; b != NIL; b = index.block(b).next) {
    if (index.block(b).pins == 0) {
      found = b;
      break;
    }
    passed.push_back(b);
  }
  for (uint32_t b : passed) {
    unlink(index, order, b);
    push_back(index, order, b, list);
  }
  return found;
}

}  // namespace

void Eviction::insert(Index& index, Policy& policy, uint32_t b) {
  Block& block = index.block(b);
  if (!policy.arc) {
    if (block.list) unlink(index, policy.t1, b);
    push_back(index, policy.t1, b, 1);
    return;
  }
  double c = policy.capacity;
  const IndexKey& k = block.ik;
  if (policy.b1.has(k)) {
    policy.p = std::min(c, policy.p + std::max((double)policy.b2.order.size() / (double)policy.b1.order.size(), 1.0));
    policy.b1.erase(k);
    push_back(index, policy.t2, b, 2);
  } else if (policy.b2.has(k)) {
    policy.p = std::max(0.0, policy.p - std::max((double)policy.b1.order.size() / (double)policy.b2.order.size(), 1.0));
    policy.b2.erase(k);
    push_back(index, policy.t2, b, 2);
  } else {
    push_back(index, policy.t1, b, 1);
  }
  while ((double)(policy.t1.size + policy.b1.order.size()) > c && !policy.b1.order.empty()) policy.b1.pop_oldest();
  while ((double)(policy.t1.size + policy.t2.size + policy.b1.order.size() + policy.b2.order.size()) > 2 * c &&
         !policy.b2.order.empty())
    policy.b2.pop_oldest();
}

void Eviction::insert_oldest(Index& index, Policy& policy, uint32_t b) {
  // A block this daemon has not seen used: T1 under ARC, no ghost counted.
  Block& block = index.block(b);
  if (block.list) unlink(index, list_of(policy, block.list), b);
  push_front(index, policy.t1, b, 1);
}

void Eviction::touch(Index& index, Policy& policy, uint32_t b) {
  Block& block = index.block(b);
  if (!block.list) return;
  if (!policy.arc || block.list == 2) {
    Order& order = list_of(policy, block.list);
    uint8_t list = block.list;
    unlink(index, order, b);
    push_back(index, order, b, list);
    return;
  }
  unlink(index, policy.t1, b);  // used twice: T1 -> T2
  push_back(index, policy.t2, b, 2);
}

void Eviction::remove(Index& index, Policy& policy, uint32_t b) {
  Block& block = index.block(b);
  if (block.list) unlink(index, list_of(policy, block.list), b);
  if (policy.arc) {
    policy.b1.erase(block.ik);
    policy.b2.erase(block.ik);
  }
}

std::vector<uint8_t> Eviction::lists(const Policy& policy, const IndexKey* incoming) {
  if (!policy.arc) return {1};
  bool from_t1_first =
      policy.t1.size > 0 && ((double)policy.t1.size > policy.p ||
                             (incoming != nullptr && policy.b2.has(*incoming) &&
                              (int64_t)policy.t1.size == (int64_t)policy.p));
  return from_t1_first ? std::vector<uint8_t>{1, 2} : std::vector<uint8_t>{2, 1};
}

uint32_t Eviction::oldest(Index& index, Policy& policy, const IndexKey* incoming) {
  for (uint8_t list : lists(policy, incoming)) {
    uint32_t b = first(index, list_of(policy, list), list);
    if (b != NIL) return b;
  }
  return NIL;
}

void Eviction::evict(Index& index, Policy& policy, uint32_t b) {
  Block& block = index.block(b);
  uint8_t list = block.list;
  if (!list) return;
  unlink(index, list_of(policy, list), b);
  if (policy.arc) (list == 1 ? policy.b1 : policy.b2).add(block.ik);
}

uint32_t Eviction::victim(Index& index, Policy& policy, const IndexKey* incoming) {
  uint32_t b = oldest(index, policy, incoming);
  if (b != NIL) evict(index, policy, b);
  return b;
}

double Eviction::share(const Scope& scope, double capacity, size_t active) {
  return scope.quota >= 0 ? (double)scope.quota : capacity / (double)std::max<size_t>(1, active);
}

std::vector<uint32_t> Eviction::victims(const std::vector<Scope>& scopes, uint32_t incoming,
                                        const std::vector<std::pair<uint32_t, int64_t>>& held, double capacity,
                                        double total) {
  // `held` in the order of the index's _held: scopes as they first held slots.
  if (held.size() == 1 && held[0].first == incoming) return {incoming};
  std::vector<std::pair<uint32_t, int64_t>> used = held;
  bool has = false;
  for (auto& u : used) has |= u.first == incoming;
  if (!has) used.push_back({incoming, 0});
  size_t active = 0;
  for (auto& u : used) active += u.second > 0 || u.first == incoming;
  std::vector<double> shares;
  int64_t incoming_used = 0;
  double incoming_share = 0;
  for (auto& u : used) {
    double part = share(scopes[u.first], capacity, active) / capacity;
    shares.push_back(part * total);
    if (u.first == incoming) incoming_used = u.second, incoming_share = shares.back();
  }
  if ((double)incoming_used >= incoming_share) return {incoming};
  // Under its share: the room comes from those over theirs, most over first.
  std::vector<size_t> over(used.size());
  for (size_t i = 0; i < over.size(); i++) over[i] = i;
  std::stable_sort(over.begin(), over.end(), [&](size_t a, size_t b) {
    return (double)used[a].second - shares[a] > (double)used[b].second - shares[b];
  });
  std::vector<uint32_t> out, all;
  for (size_t i : over) {
    all.push_back(used[i].first);
    if ((double)used[i].second > shares[i]) out.push_back(used[i].first);
  }
  return out.empty() ? all : out;
}

}  // namespace kvd
