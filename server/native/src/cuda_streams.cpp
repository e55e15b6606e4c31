// A GPU's copy streams: the ring's spans, and the thread of each stream that
// waits for its jobs' ends (cuda_streams.py, whose docstrings say why).
#include "cuda_streams.h"

#include <sys/prctl.h>

namespace kvd {

namespace {
// A job is expected to start when the one before it on its stream was seen
// to end (or when it was queued, if later) and to take JOB_NS, plus its bytes
// at AHEAD times the rate the stream's jobs were last seen to move, between
// MIN_BYTES_PER_NS and NOMINAL_BYTES_PER_NS (above what PCIe 5 x16 gives,
// about 55); past that its event is asked, first after FIRST_POLL_NS, then
// twice as long each time. A busy stream's jobs share the bus with the other
// direction's and move well below the nominal rate: predicted at it, each
// would be asked four or five times. AHEAD keeps the sleep ending before the
// copy does; a job done at its first ask moved at least at the rate
// predicted, which the rate then takes, so a rate seen too low climbs back by
// AHEAD a job. The rate is learned from jobs of at least LEARN_BYTES only: a
// small job's time is mostly the thread's own latency, not the bus. The floor
// bounds how late a job's end can be seen when the bus comes back: below it a
// stream is not moving at any rate but waiting (another process's time slice,
// docs/operations.md), and the asks find its end.
constexpr double NOMINAL_BYTES_PER_NS = 64.0, MIN_BYTES_PER_NS = 32.0, AHEAD = 1.15, RATE_WEIGHT = 0.25;
constexpr uint64_t LEARN_BYTES = 4 << 20;
constexpr int64_t JOB_NS = 10000, FIRST_POLL_NS = 5000, LAST_POLL_NS = 200000, SPIN_NS = 50000;
// A job that found its stream idle is asked at least this often once it is
// due, for a quarter of its predicted time (ALONE_CLOSE_NS at least): its
// prediction is early by a big job's hundreds of microseconds (a store's
// gather and hash, and the bus below the nominal rate), which the growing
// steps above would turn into seeing it end up to 200 us late. Past that it
// is late for some other reason (its GPU busy with other processes' work,
// docs/operations.md) and is asked as the others are.
constexpr int64_t ALONE_POLL_NS = 10000, ALONE_CLOSE_NS = 200000;
}  // namespace

void stamp(Job& job, uint8_t stage) {
  if (job.trace.empty()) return;  // not traced
  for (auto& s : job.trace)
    if (s.first == stage) return;
  job.trace.push_back({stage, now_ns()});
}

// ---------------------------------------------------------------- the ring's spans

bool Spans::take(uint64_t count, int64_t* start, int64_t* end) {
  uint64_t head = head_;
  if (taken_.empty()) {
    head = 0;
  } else {
    uint64_t oldest = (uint64_t)taken_.front().first;
    if (head > oldest) {  // in use: [oldest, head)
      if (head + count > entries_) {
        head = 0;
        if (count > oldest) return false;
      }
    } else if (head + count > oldest) {  // wrapped; free: [head, oldest)
      return false;
    }
  }
  if (head + count > entries_) return false;
  *start = (int64_t)head;
  *end = (int64_t)(head + count);
  head_ = head + count;
  taken_.push_back({*start, *end});
  return true;
}

void Spans::give_back(int64_t start, int64_t end) {
  if (!taken_.empty() && taken_.front() == std::make_pair(start, end)) {
    taken_.pop_front();
    return;
  }
  for (auto it = taken_.begin(); it != taken_.end(); ++it)
    if (*it == std::make_pair(start, end)) {
      taken_.erase(it);
      return;
    }
}

// ---------------------------------------------------------------- a stream and its thread

Ended CopyStream::ended(Tracked& item, int rc) {
  Job* job = item.job;
  stamp(*job, GPU_DONE);
  if (rc) return Ended{job, false, format("copy failed on the GPU: %s (CUDA error %d)", api->error_string(rc), rc)};
  volatile int64_t* ring = reinterpret_cast<volatile int64_t*>(config.ring_host);
  if (item.hash_index >= 0) {
    job->hashes.resize(item.rows);
    for (uint64_t i = 0; i < item.rows; i++) job->hashes[i] = (uint64_t)ring[item.hash_index + (int64_t)i];
  }
  if (item.fence_index >= 0) {
    if ((uint64_t)ring[item.fence_index] < item.fence_seq)
      // The event fired but the worker never wrote its fence: it died before
      // its compute ended, and the blocks hold no valid data.
      return Ended{job, false, "the worker's compute did not finish (the worker died?)"};
  }
  return Ended{job, true, ""};
}

CopyStream::Waited CopyStream::wait_for(const Tracked& item) {
  // Asleep until the job should have ended, then asking its event: a few
  // queries a job instead of a wake-up by the driver's event thread for each
  // (cudaEventBlockingSync) or a core spinning. A small job that had the
  // stream to itself is asked closely for a while, so that it is not late.
  // Predicted from the observed end of the job before it, not from that job's
  // prediction: predictions chained at a nominal rate would pace a busy stream
  // at that rate, whatever the bus does. A job alone has the bus to itself:
  // the nominal rate, not the one learned from jobs that shared it.
  bool learned = rate > 0 && !item.alone;
  Waited waited{std::max(last_end_ns, item.queued_ns),
                learned ? std::min(NOMINAL_BYTES_PER_NS, rate * AHEAD) : NOMINAL_BYTES_PER_NS, true, 0};
  int64_t duration = JOB_NS + (int64_t)((double)item.bytes / waited.rate);
  int64_t expected = waited.start + duration;
  int64_t now = now_ns();
  if (expected > now + 2000) std::this_thread::sleep_for(std::chrono::nanoseconds(expected - now));
  int64_t spin_until = item.spin ? now_ns() + SPIN_NS : 0;
  int64_t close_until = item.alone ? std::max(now, expected) + std::max(ALONE_CLOSE_NS, duration / 4) : 0;
  int64_t backoff = FIRST_POLL_NS;
  while ((waited.rc = api->event_query(item.event)) == NOT_READY) {
    waited.overslept = false;
    int64_t at = now_ns();
    if (at < spin_until) continue;
    std::this_thread::sleep_for(std::chrono::nanoseconds(backoff));
    backoff = std::min(backoff * 2, at < close_until ? ALONE_POLL_NS : LAST_POLL_NS);
  }
  return waited;
}

void CopyStream::saw(const Tracked& item, const Waited& waited, int64_t seen) {
  // Only a job that waited behind another started when that one ended: a job
  // alone also paid its launch, and a store alone its gather and hash.
  if (item.alone || waited.start != last_end_ns || item.bytes < LEARN_BYTES) return;
  double took = (double)std::max<int64_t>(seen - waited.start - JOB_NS, 1000);
  double before = rate > 0 ? rate : NOMINAL_BYTES_PER_NS;
  double smoothed = (1 - RATE_WEIGHT) * before + RATE_WEIGHT * ((double)item.bytes / took);
  rate = std::clamp(waited.overslept ? std::max(smoothed, waited.rate) : smoothed, MIN_BYTES_PER_NS,
                    NOMINAL_BYTES_PER_NS);
}

void CopyStream::run() {
  api->set_device(device);
  prctl(PR_SET_TIMERSLACK, 1000);  // its sleeps are tens of microseconds: not the default 50 us slack
  std::unique_lock<std::mutex> lock(mutex);
  for (;;) {
    wake.wait(lock, [this] { return stopping || !pending.empty(); });
    if (pending.empty()) return;  // stopping
    Tracked first = pending.front();
    lock.unlock();
    Waited waited = wait_for(first);
    // It, and every job after it that has ended too, go to the loop together
    // (each with what its one ask answered).
    std::vector<std::pair<Tracked, int>> items;
    lock.lock();
    items.push_back({pending.front(), waited.rc});
    pending.pop_front();
    for (int rc; !pending.empty() && (rc = api->event_query(pending.front().event)) != NOT_READY;) {
      items.push_back({pending.front(), rc});
      pending.pop_front();
    }
    lock.unlock();
    int64_t seen = now_ns();
    saw(first, waited, seen);
    last_end_ns = seen;
    std::vector<Ended> ended;
    for (auto& item : items) ended.push_back(this->ended(item.first, item.second));
    done += ended.size();
    // Finishing them here may have queued jobs of another GPU from this thread.
    if (completions->deliver(std::move(ended))) api->set_device(device);
    lock.lock();
  }
}

}  // namespace kvd
