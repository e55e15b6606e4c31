// Records of the pool kept across restarts (port of the sealing half of
// server/tiers/warm.py): each committed shard's bytes are hashed on a thread
// of the sealer's, and its record (host/shard_record.py's format) is written
// on the loop's thread, only if the slot was not released meanwhile.
#pragma once

#include "index.h"
#include "jobs.h"

namespace kvd {

class Sealer {
 public:
  Sealer(Slots& slots, const uint8_t* pool, uint64_t slot_bytes, Completions& wake);
  ~Sealer();
  // On the lane's thread: rank `rank` of `blocks` were committed with `length`
  // bytes. With `hashes` (the GPU's, host/shard_hash.py) their records are
  // written now; else their bytes are hashed (xxh3) on the sealer's thread.
  void seal(Index& index, const Namespace& ns, uint32_t rank, const std::vector<uint32_t>& blocks, uint64_t length,
            const std::vector<uint64_t>* hashes = nullptr);
  // On the loop: the records hashed since, written where their slot is still theirs.
  void write_sealed();
  uint64_t unsealed() const { return unsealed_; }

  uint64_t generation = 0;
  uint64_t sealed = 0;
  uint64_t skipped = 0;

 private:
  struct Item {
    int64_t slot;
    uint64_t epoch;
    uint8_t record[RECORD_BYTES];
    uint64_t length;
  };
  void run();

  Slots& slots_;
  const uint8_t* pool_;
  uint64_t slot_bytes_;
  Completions& wake_;
  uint64_t max_unsealed_;
  uint64_t unsealed_ = 0;  // the loop's count: queued, being hashed, or waiting to be written
  std::mutex mutex_;
  std::condition_variable work_;
  std::vector<Item> queue_, done_;
  bool stopping_ = false;
  std::thread thread_;
};

// The record of one shard (host/shard_record.py pack), its data hash given;
// `gpu_hashed`: the hash is host/shard_hash.py's, not xxh3.
void pack_record(uint8_t out[RECORD_BYTES], const std::string& ns_digest, const Key& key, uint32_t rank, uint32_t tp,
                 uint64_t length, uint64_t data_hash, uint64_t generation, bool gpu_hashed = false);
uint64_t data_hash(const uint8_t* data, size_t length);
// host/shard_hash.py's hash, on the CPU (to check records the GPU sealed).
uint64_t gpu_hash(const uint8_t* data, size_t length);

}  // namespace kvd
