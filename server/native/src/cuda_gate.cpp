// The gate: a CUDA store starts only once its worker's compute event has
// completed. The lane's thread asks the events on the host (cuda_streams.py
// ComputeGate), so that a worker killed mid-compute stalls no stream, and
// wakes for the next ask on its timer (Transport::due): a store let through
// is launched in the round that asks it, with no thread between.
#include "cuda_streams.h"

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
  if (job.event) {
    int64_t now = now_ns();
    // Stores waiting go first: this one is asked in their round, at once.
    if (!gate_.empty()) {
      job.at_gate = true;
      gate_.push_back({&job, now, now, -1});
      gate_due_ = now;
      return;
    }
    // Most stores arrive after their compute ended: no round at the gate.
    int rc = api_.event_query(job.event);
    if (rc == NOT_READY) {
      job.at_gate = true;
      gate_.push_back({&job, now, next_gate_ask(now, now, shortest_wait()), now});
      gate_due_ = gate_.back().next_ask;
      return;
    }
    if (rc != 0) {
      fail(job, format("waiting for the worker's compute failed: %s", api_.error_string(rc)));
      return;
    }
  }
  launch(job);
}

void CudaTransport::abandon(Job& job) {
  // A store still at the gate is dropped there; copies already queued on the
  // GPU end first (and fail, the session having ended).
  if (!job.at_gate) return;
  job.at_gate = false;
  gate_due_ = INT64_MAX;
  for (size_t i = 0; i < gate_.size();) {
    if (gate_[i].job == &job) {
      gate_.erase(gate_.begin() + i);
      continue;
    }
    gate_due_ = std::min(gate_due_, gate_[i++].next_ask);
  }
  fail(job, "the client went away before its compute finished");
}

int64_t CudaTransport::shortest_wait() const {
  return recent_.empty() ? 0 : *std::min_element(recent_.begin(), recent_.end());
}

void CudaTransport::poll() {
  if (gate_.empty()) return;
  int64_t now = now_ns();
  if (gate_due_ <= now) gate_round(now);
}

void CudaTransport::gate_round(int64_t now) {
  std::vector<std::pair<Job*, std::string>> done;
  std::vector<Waiting> still;
  std::vector<int64_t> waited;  // of the stores that ended after an ask found them not done
  // A store due that ended: every store is asked, so that stores leave in
  // the order they came. Newest first: a worker's later store seen done
  // means its earlier ones, asked after it, are done too (their compute
  // came first), where asked before it they may have ended in between.
  for (bool all = false;; all = true) {
    bool ended = false;
    for (auto it = gate_.rbegin(); it != gate_.rend(); ++it) {
      Waiting w = *it;
      if (!all && w.next_ask > now) {
        still.push_back(w);
        continue;
      }
      int rc = api_.event_query(w.job->event);
      if (rc == NOT_READY) {
        still.push_back({w.job, w.since, next_gate_ask(w.since, now, shortest_wait()), now});
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
  std::reverse(still.begin(), still.end());
  for (int64_t w : waited) {
    recent_.push_back(w);
    if (recent_.size() > GATE_RECENT) recent_.pop_front();
  }
  gate_.swap(still);
  gate_due_ = INT64_MAX;
  for (const Waiting& w : gate_) gate_due_ = std::min(gate_due_, w.next_ask);
  // Oldest first, as they came.
  for (auto it = done.rbegin(); it != done.rend(); ++it) {
    it->first->at_gate = false;
    if (it->second.empty()) launch(*it->first);
    else fail(*it->first, it->second);
  }
}

}  // namespace kvd
