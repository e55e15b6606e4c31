// Sealing committed shards' records of the kept pool (warm.py WarmPool.demote,
// _hash, _write): the loop queues each shard with its slot's epoch, the
// sealer's thread hashes its bytes (xxh3, as host/shard_record.py), and the
// loop writes the record only if the slot's epoch did not change: a slot
// released (and maybe handed out again) while its bytes were hashed keeps no
// record of bytes it may no longer hold.
#include "seal.h"

#define XXH_INLINE_ALL
#include "../third_party/xxhash/xxhash.h"

namespace kvd {

namespace {
// shard_record.py: magic, format, flags, generation, namespace digest, key,
// rank, tp_size, length, data hash (96 bytes); then the hash of those.
constexpr uint32_t FORMAT_VERSION = 1;
constexpr uint32_t FLAG_SEALED = 1, FLAG_GPU_HASH = 2;
constexpr size_t FIELDS_BYTES = 96;
// Shards waiting to be sealed, at most, beyond the pool's slots (warm.py MAX_UNSEALED).
constexpr uint64_t MAX_UNSEALED = 1 << 16;

template <class T>
uint8_t* put(uint8_t* at, T value) {
  std::memcpy(at, &value, sizeof value);  // little-endian, as struct "<"
  return at + sizeof value;
}
}  // namespace

uint64_t data_hash(const uint8_t* data, size_t length) { return XXH3_64bits(data, length); }

void pack_record(uint8_t out[RECORD_BYTES], const std::string& ns_digest, const Key& key, uint32_t rank, uint32_t tp,
                 uint64_t length, uint64_t hash, uint64_t generation, bool gpu_hashed) {
  std::memset(out, 0, RECORD_BYTES);
  uint8_t* at = out;
  std::memcpy(at, "KVDSHRD1", 8);
  at += 8;
  at = put(at, FORMAT_VERSION);
  at = put(at, gpu_hashed ? FLAG_SEALED | FLAG_GPU_HASH : FLAG_SEALED);
  at = put(at, generation);
  std::memcpy(at, ns_digest.data(), std::min<size_t>(16, ns_digest.size()));
  at += 16;
  std::memcpy(at, key.b, KEY_BYTES);
  at += KEY_BYTES;
  at = put(at, rank);
  at = put(at, tp);
  at = put(at, length);
  at = put(at, hash);
  put(at, (uint64_t)XXH3_64bits(out, FIELDS_BYTES));
}

Sealer::Sealer(Slots& slots, const uint8_t* pool, uint64_t slot_bytes, Completions& wake)
    : slots_(slots),
      pool_(pool),
      slot_bytes_(slot_bytes),
      wake_(wake),
      max_unsealed_(std::max<uint64_t>((uint64_t)slots.num_slots(), MAX_UNSEALED)),
      thread_([this] {
        name_thread("kvdepot-seal");
        run();
      }) {}

Sealer::~Sealer() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_.notify_all();
  thread_.join();
}

void Sealer::seal(Index& index, const Namespace& ns, uint32_t rank, const std::vector<uint32_t>& blocks,
                  uint64_t length, const std::vector<uint64_t>* hashes) {
  if (ns.digest.empty()) {
    skipped += blocks.size();
    return;
  }
  if (hashes) {
    // The GPU hashed the bytes as it stored them: the records go in now (their
    // slots are this commit's, on this thread: no epoch can have moved).
    for (size_t i = 0; i < blocks.size(); i++) {
      const Block& block = index.block(blocks[i]);
      pack_record(slots_.record(block.shards[rank].slot), ns.digest, block.ik.key, rank, ns.tp, length, (*hashes)[i],
                  ++generation, true);
      sealed++;
    }
    return;
  }
  if (unsealed_ + blocks.size() > max_unsealed_) {
    // Stores outrun the hashing: these are not kept across a restart, rather
    // than the backlog growing.
    skipped += blocks.size();
    return;
  }
  std::vector<Item> items(blocks.size());
  for (size_t i = 0; i < blocks.size(); i++) {
    const Block& block = index.block(blocks[i]);
    Item& item = items[i];
    item.slot = block.shards[rank].slot;
    item.epoch = slots_.epoch(item.slot);
    item.length = length;
    pack_record(item.record, ns.digest, block.ik.key, rank, ns.tp, length, 0, ++generation);
  }
  unsealed_ += blocks.size();
  bool was_idle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    was_idle = queue_.empty();
    for (Item& item : items) queue_.push_back(item);
  }
  if (was_idle) work_.notify_one();
}

void Sealer::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_ && queue_.empty()) return;
    std::vector<Item> batch;
    batch.swap(queue_);
    lock.unlock();
    for (Item& item : batch) {
      // A slot handed out again is skipped here; the check on the loop is the one that counts.
      if (slots_.epoch(item.slot) != item.epoch) continue;
      uint64_t hash = data_hash(pool_ + (uint64_t)item.slot * slot_bytes_, item.length);
      std::memcpy(item.record + 88, &hash, 8);
      uint64_t own = XXH3_64bits(item.record, FIELDS_BYTES);
      std::memcpy(item.record + FIELDS_BYTES, &own, 8);
    }
    lock.lock();
    for (Item& item : batch) done_.push_back(item);
    lock.unlock();
    wake_.poke();
    lock.lock();
  }
}

void Sealer::write_sealed() {
  std::vector<Item> done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done.swap(done_);
  }
  for (Item& item : done) {
    unsealed_--;
    // Epochs only grow: one that changed before the hashing changed for good.
    if (slots_.epoch(item.slot) != item.epoch) continue;
    std::memcpy(slots_.record(item.slot), item.record, RECORD_BYTES);
    sealed++;
  }
}

}  // namespace kvd

namespace kvd {

namespace {
constexpr size_t HASH_BLOCK_WORDS = 512;  // host/shard_hash.py BLOCK_WORDS
constexpr uint64_t HASH_SEED = 0x6B766465706F7421ull;

uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct HashKeys {
  uint32_t k[4][HASH_BLOCK_WORDS];
  HashKeys() {
    uint64_t x = HASH_SEED;
    for (auto& row : k)
      for (uint32_t& value : row) {
        x += 0x9E3779B97F4A7C15ull;
        value = (uint32_t)mix(x);
      }
  }
};

// One block's two sums; compiled for AVX2 too where the CPU has it.
__attribute__((target_clones("avx2", "default"))) void block_sums(const uint8_t* data, size_t words, const HashKeys& keys,
                                                                  uint64_t* a, uint64_t* b) {
  uint64_t sa = 0, sb = 0;
  for (size_t i = 0; i < words; i++) {
    uint64_t w;
    std::memcpy(&w, data + 8 * i, 8);
    uint32_t lo = (uint32_t)w, hi = (uint32_t)(w >> 32);
    sa += (uint64_t)(uint32_t)(lo + keys.k[0][i]) * (uint32_t)(hi + keys.k[1][i]);
    sb += (uint64_t)(uint32_t)(lo + keys.k[2][i]) * (uint32_t)(hi + keys.k[3][i]);
  }
  *a = sa;
  *b = sb;
}
}  // namespace

uint64_t gpu_hash(const uint8_t* data, size_t length) {
  static const HashKeys keys;
  size_t words = length / 8;
  uint64_t total = 0;
  for (size_t j = 0, start = 0; start < words; j++, start += HASH_BLOCK_WORDS) {
    uint64_t a, b;
    block_sums(data + 8 * start, std::min(HASH_BLOCK_WORDS, words - start), keys, &a, &b);
    total += mix(a ^ mix(b + j + 1));
  }
  return mix(total + length);
}

}  // namespace kvd
