// The gate: a CUDA store starts only once its worker's compute event has
// completed. Its thread asks the events on the host (cuda_streams.py
// ComputeGate), so that a worker killed mid-compute stalls no stream.
#include "cuda_streams.h"

#include <sys/prctl.h>

namespace kvd {

namespace {
// A store at the gate is asked at once, then every GATE_POLL_NS for its first
// GATE_FAST_NS (a store submitted just after its compute: the benchmarks'
// case), then every quarter of the time it has waited, at most every
// GATE_SLOW_NS: a store waiting out a forward pass (tens of milliseconds) is
// asked a few dozen times, not every 40 us, and seen at most a quarter of its
// wait, and 1 ms, late. Nor is it asked before 3/4 of the shortest wait of the
// last GATE_RECENT stores that were not done at once, since forward passes are
// alike. A store's wait is taken as the time to its last ask that found it
// not done (a lower bound: the gate's own lateness is not in it), so one store
// shorter than the others puts the next ones back on the schedule above.
constexpr int64_t GATE_POLL_NS = 40000, GATE_FAST_NS = 500000, GATE_SLOW_NS = 1000000;
constexpr size_t GATE_RECENT = 16;

int64_t next_gate_ask(int64_t since, int64_t now, int64_t shortest) {
  int64_t waited = now - since;
  int64_t next = now + (waited < GATE_FAST_NS ? GATE_POLL_NS : std::min(GATE_SLOW_NS, waited / 4));
  return std::max(next, since + shortest / 4 * 3);
}

}  // namespace

void CudaTransport::start(Job& job) {
  if (job.slots.empty()) {
    completions_.push(Ended{&job, true, ""});
    return;
  }
  // Most stores arrive after their compute ended: no trip through the gate,
  // unless stores wait there (they go first).
  if (job.event && (held_at_gate_ || api_.event_query(job.event) != 0)) {
    held_at_gate_++;
    job.at_gate = true;
    {
      std::lock_guard<std::mutex> lock(gate_mutex_);
      gate_new_.push_back(&job);
    }
    gate_wake_.notify_one();
    return;
  }
  launch(job);
}

void CudaTransport::abandon(Job& job) {
  // A store still at the gate is dropped there; copies already queued on the
  // GPU end first (and fail, the session having ended).
  if (!job.at_gate) return;
  {
    std::lock_guard<std::mutex> lock(gate_mutex_);
    gate_abandoned_.insert(&job);
  }
  gate_wake_.notify_one();
}

void CudaTransport::gate_run() {
  prctl(PR_SET_TIMERSLACK, 1000);
  struct Waiting {
    Job* job;
    int64_t since, next_ask;
    int64_t not_done_at;  // when an ask last found it not done; -1: never
  };
  std::vector<Waiting> waiting;  // in the order they came
  // How long the last GATE_RECENT stores not done at their first ask waited.
  std::deque<int64_t> recent;
  auto shortest = [&recent] { return recent.empty() ? 0 : *std::min_element(recent.begin(), recent.end()); };
  std::unique_lock<std::mutex> lock(gate_mutex_);
  // Stores queued or abandoned while the thread asked events (unlocked) are
  // seen here, not left to the next store due.
  auto news = [this] { return stopping_ || !gate_new_.empty() || !gate_abandoned_.empty(); };
  for (;;) {
    if (waiting.empty()) {
      gate_wake_.wait(lock, news);
    } else {
      int64_t next = waiting.front().next_ask;
      for (const Waiting& w : waiting) next = std::min(next, w.next_ask);
      int64_t left = next - now_ns();
      if (left > 0) gate_wake_.wait_for(lock, std::chrono::nanoseconds(left), news);
    }
    if (stopping_) return;
    int64_t now = now_ns();
    // A store that came is asked at once (it may be done already).
    for (Job* job : gate_new_) waiting.push_back({job, now, now, -1});
    gate_new_.clear();
    std::unordered_set<Job*> abandoned;
    abandoned.swap(gate_abandoned_);
    lock.unlock();
    std::vector<std::pair<Job*, std::string>> done;
    std::vector<Waiting> still;
    std::vector<int64_t> waited;  // of the stores that ended after an ask found them not done
    // A store due that ended: every store is asked, so that stores leave in
    // the order they came. Newest first: a worker's later store seen done
    // means its earlier ones, asked after it, are done too (their compute
    // came first), where asked before it they may have ended in between.
    for (bool all = false;; all = true) {
      bool ended = false;
      for (auto it = waiting.rbegin(); it != waiting.rend(); ++it) {
        Waiting w = *it;
        if (abandoned.count(w.job)) {
          done.push_back({w.job, "the client went away before its compute finished"});
          continue;
        }
        if (!all && w.next_ask > now) {
          still.push_back(w);
          continue;
        }
        int rc = api_.event_query(w.job->event);
        if (rc == NOT_READY) {
          still.push_back({w.job, w.since, next_gate_ask(w.since, now, shortest()), now});
          continue;
        }
        if (rc == 0) {
          ended = true;
          // A wait is learned only from a store asked on its schedule: one
          // asked early (another store ended) was done at some time unknown.
          if (w.not_done_at >= 0 && w.next_ask <= now) waited.push_back(w.not_done_at - w.since);
        }
        // One bad event must not stop every other store.
        done.push_back({w.job, rc == 0 ? "" : format("waiting for the worker's compute failed: %s",
                                                      api_.error_string(rc))});
      }
      if (all || !ended) break;
      done.clear();
      still.clear();
      waited.clear();
    }
    std::reverse(done.begin(), done.end());
    std::reverse(still.begin(), still.end());
    for (int64_t w : waited) {
      recent.push_back(w);
      if (recent.size() > GATE_RECENT) recent.pop_front();
    }
    waiting.swap(still);
    lock.lock();
    if (!done.empty()) {
      for (auto& d : done) gate_done_.push_back(std::move(d));
      completions_.poke();
    }
  }
}

void CudaTransport::poll() {
  std::vector<std::pair<Job*, std::string>> done;
  {
    std::lock_guard<std::mutex> lock(gate_mutex_);
    done.swap(gate_done_);
  }
  for (auto& d : done) {
    held_at_gate_--;
    d.first->at_gate = false;
    if (d.second.empty()) launch(*d.first);
    else fail(*d.first, d.second);
  }
}

}  // namespace kvd
