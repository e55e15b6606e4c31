// The lane put together: its thread, which waits on its epoll set (the job
// connections, one eventfd that the transports' and the sealer's threads
// write, a timer for the transports' own work when due, one eventfd that
// stops it) and serves what is ready under the lane's lock;
// a CUDA stream's completion thread that finds the lane thread asleep and
// that lock free finishes its own jobs; and what the index tells the rest.
#include "lane_impl.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace kvd {

namespace {
// The epoll set's data of its eventfds and timer; connections are 1 and up.
constexpr uint64_t WAKE = 0;
constexpr uint64_t TIMER = UINT64_MAX - 1;
constexpr uint64_t STOP = UINT64_MAX;
}  // namespace

Lane::Lane(const LaneConfig& c) : config(c) {
  epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  python_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);  // now_ns()'s clock
  if (epoll_fd < 0 || event_fd < 0 || stop_fd < 0 || python_fd < 0 || timer_fd < 0)
    throw std::runtime_error("cannot make the lane's epoll set");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = WAKE;
  epoll_ctl(epoll_fd, EPOLL_CTL_ADD, event_fd, &ev);
  ev.data.u64 = STOP;
  epoll_ctl(epoll_fd, EPOLL_CTL_ADD, stop_fd, &ev);
  ev.data.u64 = TIMER;
  epoll_ctl(epoll_fd, EPOLL_CTL_ADD, timer_fd, &ev);
  std::vector<Slots::Range> ranges;
  for (uint32_t i = 0; i < c.n_ranges; i++) ranges.push_back({c.ranges[i].node, c.ranges[i].first, c.ranges[i].count});
  slots.reset(new Slots(c.num_slots, ranges, c.chunk_slots, c.extent_slots, c.slot_bytes,
                        reinterpret_cast<uint8_t*>(c.records_base)));
  index.reset(new Index(*slots, *this, c.arc != 0, c.num_slots, c.seed));
  completions.reset(new Completions(event_fd));
  completions->finish_here = [this] { return finish_here(); };
  jobs.reset(new Jobs(*index, *slots, events, *completions, *this));
  jobs->tracing = c.tracing != 0;
  conns.reset(new Conns(epoll_fd, *jobs, events, c.max_unread, c.max_frame_bytes_per_uid));
  uint8_t* pool = reinterpret_cast<uint8_t*>(c.pool_base);
  sealer.reset(new Sealer(*slots, pool, c.slot_bytes, *completions));
  shm.reset(new ShmTransport(pool, c.slot_bytes, *completions));
  jobs->transports[(int)TransportKind::SHM] = shm.get();
}

Lane::~Lane() {
  stop();
  // Copy threads end first: their jobs' memory is the lane's.
  cuda.reset();
  shm.reset();
  sealer.reset();
  conns.reset();
  jobs.reset();
  for (int fd : {event_fd, stop_fd, python_fd, timer_fd, epoll_fd}) close(fd);
}

thread_local bool on_lane_thread = false;

void Lane::start() {
  thread_ = std::thread([this] {
    name_thread("kvdepot-lane");
    on_lane_thread = true;
    run();
  });
}

void Lane::stop() {
  {
    // From here the copy threads hand what ends to the loop, which is stopping:
    // a stopped lane (kvd_close) may be left to the process's exit with copies
    // running, and its parts are destroyed after it.
    std::lock_guard<std::mutex> lock(mutex);
    stopped_ = true;
  }
  if (!thread_.joinable()) return;
  uint64_t one = 1;
  ssize_t n = write(stop_fd, &one, sizeof one);
  (void)n;
  thread_.join();
}

void Lane::run() {
  epoll_event ready[256];
  for (;;) {
    asleep_.store(true, std::memory_order_relaxed);
    int n = epoll_wait(epoll_fd, ready, 256, -1);
    asleep_.store(false, std::memory_order_relaxed);
    if (n < 0) continue;  // EINTR
    for (int i = 0; i < n; i++)
      if (ready[i].data.u64 == STOP) return;
    std::lock_guard<std::mutex> lock(mutex);
    serve(ready, n);
  }
}

void Lane::serve(const epoll_event* ready, int n) {
  bool timer_alone = true;
  for (int i = 0; i < n; i++) {
    uint64_t data = ready[i].data.u64;
    if (data == TIMER) {
      uint64_t expirations;
      ssize_t got = read(timer_fd, &expirations, sizeof expirations);  // EAGAIN where it was set anew since
      (void)got;
      continue;
    }
    timer_alone = false;
    if (data != WAKE) conns->on_epoll((uint32_t)data, ready[i].events);
  }
  if (!timer_alone) {
    finish_ended();
    return;
  }
  // The timer alone: a store at the gate is due. What the round does needs
  // nothing else of a round (a store let through goes to its stream, one
  // that failed comes back through the completions' eventfd), and a store
  // waiting out a forward pass is asked a few times: a whole round each time
  // cost the lane more than the gate's own thread did.
  for (Transport* transport : jobs->transports)
    if (transport) transport->poll();
  arm();
}

bool Lane::finish_here() {
  // Never waits for the lock: its holder (the loop, or Python's call) may be
  // waiting on this copy thread, and the loop takes what is left anyway.
  if (!asleep_.load(std::memory_order_relaxed)) return false;
  std::unique_lock<std::mutex> lock(mutex, std::try_to_lock);
  if (!lock.owns_lock() || stopped_) return false;
  finish_ended();
  return true;
}

void Lane::finish_ended() {
  // The wake-up is taken before anything it stands for is looked at: the
  // sealer's records are handed over before their poke, and a part that
  // hands work over after this wakes the loop again.
  std::vector<Ended> ended = completions->take();
  for (Transport* transport : jobs->all_transports()) transport->poll();
  sealer->write_sealed();
  if (!ended.empty()) jobs->finish(ended);
  conns->flush();
  if (config.check) {
    std::string problem = index->verify();
    if (!problem.empty()) {
      // Only where the tests ask (KVDEPOT_CHECK_INDEX): a wrong count must stop everything.
      std::fprintf(stderr, "the native lane's index is inconsistent: %s\n", problem.c_str());
      std::abort();
    }
  }
  tell_python();
  arm();
}

void Lane::arm() {
  int64_t due = INT64_MAX;
  for (Transport* transport : jobs->transports)
    if (transport) due = std::min(due, transport->due());
  if (due == INT64_MAX) return;  // a timer still set only wakes the loop for nothing
  // Set already, at or before then: its round asks again.
  if (timer_at_ <= due && timer_at_ > now_ns()) return;
  timer_at_ = due;
  itimerspec at{};
  at.it_value.tv_sec = due / 1000000000;
  at.it_value.tv_nsec = due % 1000000000;
  if (at.it_value.tv_sec == 0 && at.it_value.tv_nsec == 0) at.it_value.tv_nsec = 1;  // zero would unset it
  timerfd_settime(timer_fd, TFD_TIMER_ABSTIME, &at, nullptr);
}

void Lane::tell_python() {
  if (events.empty() || python_woken_) return;
  python_woken_ = true;
  uint64_t one = 1;
  ssize_t n = write(python_fd, &one, sizeof one);
  (void)n;
}

const std::string& Lane::take_events() {
  taken_.clear();
  taken_.swap(events.buffer());
  uint64_t count;
  ssize_t n = read(python_fd, &count, sizeof count);
  (void)n;
  python_woken_ = false;
  return taken_;
}

void Lane::changed(const Namespace& ns, const Key& key, Change state) {
  if (ns.followed) events.change(ns.id, key, state);
}

void Lane::evicted(Namespace& ns) {
  jobs->totals.add(EVICTED_BLOCKS, 1);
  ns.counters.add(EVICTED_BLOCKS, 1);
}

void Lane::committed(Namespace& ns, uint32_t rank, const std::vector<uint32_t>& blocks, uint64_t length,
                     const std::vector<uint64_t>* hashes) {
  sealer->seal(*index, ns, rank, blocks, length, hashes);
  if (demote_events) {
    std::vector<uint64_t> handles;
    std::vector<Key> keys;
    for (uint32_t b : blocks) {
      handles.push_back(index->handle(b));
      keys.push_back(index->block(b).ik.key);
    }
    events.committed(ns.id, rank, length, handles, keys);
  }
}

}  // namespace kvd
