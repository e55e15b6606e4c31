// Sessions, workers and jobs (port of server/core/depot.py's job path): a job is
// checked, reserved in the index (pinned), started on its transport, and, when
// its copies end, its client is told first and then its blocks are committed
// (or rolled back), unpinned and counted.
#include "jobs.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <ctime>

namespace kvd {

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

// ---------------------------------------------------------------- events

void Events::begin(Type type, size_t length) {
  put<uint8_t>(type);
  put<uint32_t>((uint32_t)length);
}

void Events::change(uint32_t ns, const Key& key, Change state) {
  begin(CHANGE, 4 + 1 + KEY_BYTES);
  put(ns);
  put<uint8_t>((uint8_t)state);
  buffer_.append(reinterpret_cast<const char*>(key.b), KEY_BYTES);
}

void Events::job_done(uint32_t session, uint64_t job, bool ok, uint32_t already, uint32_t not_stored,
                      const std::string& error) {
  begin(JOB_DONE, 4 + 8 + 1 + 4 + 4 + error.size());
  put(session);
  put(job);
  put<uint8_t>(ok);
  put(already);
  put(not_stored);
  buffer_.append(error);
}

void Events::log(int level, const std::string& text, const std::string& key) {
  size_t k = std::min<size_t>(key.size(), 255);
  begin(LOG, 2 + k + text.size());
  put<uint8_t>((uint8_t)level);
  put<uint8_t>((uint8_t)k);
  buffer_.append(key, 0, k);
  buffer_.append(text);
}

void Events::released(uint32_t worker) {
  begin(RELEASED, 4);
  put(worker);
}

void Events::conn_closed(uint32_t conn, uint32_t session, uint8_t kind) {
  begin(CONN_CLOSED, 4 + 4 + 1);
  put(conn);
  put(session);
  put(kind);
}

void Events::committed(uint32_t ns, uint32_t rank, uint64_t length, const std::vector<uint64_t>& handles,
                       const std::vector<Key>& keys) {
  begin(COMMITTED, 4 + 4 + 8 + (8 + KEY_BYTES) * handles.size());
  put(ns);
  put(rank);
  put(length);
  for (size_t i = 0; i < handles.size(); i++) {
    put(handles[i]);
    buffer_.append(reinterpret_cast<const char*>(keys[i].b), KEY_BYTES);
  }
}

void Events::trace(uint32_t session, uint64_t job, JobKind kind, uint32_t blocks,
                   const std::vector<std::pair<uint8_t, int64_t>>& stamps) {
  begin(TRACE, 4 + 8 + 1 + 4 + 9 * stamps.size());
  put(session);
  put(job);
  put<uint8_t>((uint8_t)kind);
  put(blocks);
  for (auto& stamp : stamps) {
    put(stamp.first);
    put(stamp.second);
  }
}

// ---------------------------------------------------------------- completions

void Completions::push(std::vector<Ended>&& ended) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Ended& e : ended) ended_.push_back(std::move(e));
  wake();
}

void Completions::push(Ended&& ended) {
  std::lock_guard<std::mutex> lock(mutex_);
  ended_.push_back(std::move(ended));
  wake();
}

bool Completions::deliver(std::vector<Ended>&& ended) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Ended& e : ended) ended_.push_back(std::move(e));
    if (woken_) return false;  // the loop is awake already and takes these with the rest
  }
  if (finish_here && finish_here()) return true;
  // Not finished here (the loop awake, or the lock held, perhaps by a round
  // that has taken its completions already): the loop is woken for these.
  std::lock_guard<std::mutex> lock(mutex_);
  if (!ended_.empty()) wake();
  return false;
}

void Completions::poke() {
  std::lock_guard<std::mutex> lock(mutex_);
  wake();
}

void Completions::wake() {
  // One wake-up of the loop however many end before it looks.
  if (woken_) return;
  woken_ = true;
  uint64_t one = 1;
  ssize_t written = write(eventfd_, &one, sizeof one);
  (void)written;
}

std::vector<Ended> Completions::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  woken_ = false;
  uint64_t count;
  ssize_t n = read(eventfd_, &count, sizeof count);
  (void)n;
  std::vector<Ended> out;
  out.swap(ended_);
  return out;
}

// ---------------------------------------------------------------- counters

void Clock::start(int64_t now) {
  if (in_flight++ == 0) since_ns = now;
}

void Clock::stop(int64_t now) {
  if (--in_flight == 0) total_ns += now - since_ns;
}

static const double DURATION_BUCKETS[JobTimes::BUCKETS - 1] = {0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                                                               0.2,    0.5,   1.0,   2.0,   5.0,  10.0, 30.0, 60.0};

void JobTimes::finished(JobKind kind, bool ok, double elapsed, bool client_gone) {
  int k = (int)kind;
  if (ok) {
    int bucket = (int)(std::lower_bound(DURATION_BUCKETS, DURATION_BUCKETS + BUCKETS - 1, elapsed) - DURATION_BUCKETS);
    buckets[k][bucket]++;
    seconds[k] += elapsed;
    return;
  }
  failures[k][client_gone ? 0 : 1]++;
}

void Jobs::count(Session* session, Namespace& ns, int which, uint64_t delta) {
  totals.add(which, delta);
  ns.counters.add(which, delta);
  if (session) session->counters.add(which, delta);
}

// ---------------------------------------------------------------- sessions and workers

Jobs::Jobs(Index& index, Slots& slots, Events& events, Completions& completions, Replies& replies)
    : index_(index), slots_(slots), events_(events), completions_(completions), replies_(replies) {}

Jobs::~Jobs() {
  for (auto& entry : sessions_) forget_session(entry.second);
  for (Session* s : dying_) forget_session(s);
}

void Jobs::forget_session(Session* session) {
  for (auto& entry : session->workers) delete entry.second;
  for (auto& entry : session->jobs) delete entry.second;
  delete session;
}

Session& Jobs::add_session(uint32_t handle, uint32_t number, const std::string& id, uint64_t max_jobs) {
  Session* s = new Session();
  s->handle = handle;
  s->number = number;
  s->id = id;
  s->max_jobs = max_jobs;
  sessions_[handle] = s;
  return *s;
}

Session* Jobs::session(uint32_t handle) {
  auto found = sessions_.find(handle);
  return found == sessions_.end() ? nullptr : found->second;
}

void Jobs::end_session(uint32_t handle) {
  Session* s = session(handle);
  if (s == nullptr) return;
  sessions_.erase(handle);
  s->ended = true;
  s->conn = -1;
  sessions_ended++;
  std::vector<Job*> jobs;
  for (auto& entry : s->jobs) jobs.push_back(entry.second);
  for (Job* job : jobs) transports[(int)job->worker->transport]->abandon(*job);
  dying_.insert(s);
  std::vector<Worker*> workers;
  for (auto& entry : s->workers) workers.push_back(entry.second);
  for (Worker* w : workers) {
    w->closing = true;
    if (w->in_flight == 0) copies_ended(*w);
  }
  forget_if_done(s);
}

void Jobs::forget_if_done(Session* s) {
  // An ended session is freed once its last job and worker are gone.
  if (s->ended && s->jobs.empty() && s->workers.empty() && dying_.erase(s)) forget_session(s);
}

Worker& Jobs::add_worker(Session& session, uint32_t id, Namespace& ns, uint32_t rank, uint64_t num_blocks,
                         uint64_t block_bytes, int32_t node, TransportKind transport) {
  Worker* w = new Worker();
  w->id = id;
  w->session = &session;
  w->ns = ns.id;
  w->rank = rank;
  w->num_blocks = num_blocks;
  w->block_bytes = block_bytes;
  w->node = node;
  w->transport = transport;
  session.workers[id] = w;
  return *w;
}

Worker* Jobs::worker(Session& session, uint32_t id) {
  auto found = session.workers.find(id);
  return found == session.workers.end() || found->second->closing ? nullptr : found->second;
}

void Jobs::copies_ended(Worker& worker) {
  if (!worker.closing || worker.in_flight) return;
  Session* s = worker.session;
  Transport* t = transports[(int)worker.transport];
  if (t) t->forget(worker);
  events_.released(worker.id);
  s->workers.erase(worker.id);
  delete &worker;
}

// ---------------------------------------------------------------- jobs

static std::vector<Key> checked_keys(const JobRequest& r, int64_t pool_slots, uint64_t worker_blocks) {
  size_t n = r.keys.size();
  if (n != r.block_ids.size())
    throw Refusal{INVALID_ARGUMENT, format("%zu keys but %zu block ids: give one block id for each key", n,
                                           r.block_ids.size())};
  if (n == 0) throw Refusal{INVALID_ARGUMENT, "a job needs at least one block"};
  if ((int64_t)n > pool_slots)
    throw Refusal{RESOURCE_EXHAUSTED,
                  format("the job has %zu blocks but the whole pool holds %lld: split it or start kvdepotd with a "
                         "larger --pool-size",
                         n, (long long)pool_slots)};
  std::vector<Key> keys(n);
  for (size_t i = 0; i < n; i++) {
    if (r.keys[i].second != KEY_BYTES)
      throw Refusal{INVALID_ARGUMENT,
                    format("key %zu has %zu bytes; keys are %zu-byte hashes", i, r.keys[i].second, KEY_BYTES)};
    std::memcpy(keys[i].b, r.keys[i].first, KEY_BYTES);
  }
  for (size_t i = 0; i < n; i++) {
    if (r.block_ids[i] >= worker_blocks)
      throw Refusal{INVALID_ARGUMENT,
                    format("block id %u at position %zu is outside the worker's registered tensors (%llu blocks)",
                           r.block_ids[i], i, (unsigned long long)worker_blocks)};
  }
  return keys;
}

Submitted Jobs::submit(Session& session, JobRequest& request, int64_t received_ns) {
  if (draining) throw Refusal{UNAVAILABLE, "the daemon is shutting down and takes no new jobs"};
  Worker* worker = this->worker(session, request.worker);
  if (worker == nullptr)
    throw Refusal{NOT_FOUND, format("unknown worker %u in this session: register it first", request.worker)};
  if (session.jobs.count(request.job) || session.recent_set.count(request.job))
    throw Refusal{ALREADY_EXISTS,
                  format("job id %llu is already used by this session", (unsigned long long)request.job)};
  if (session.jobs.size() >= session.max_jobs)
    throw Refusal{RESOURCE_EXHAUSTED,
                  format("this session has %zu jobs in flight, the most one session may (--max-jobs-per-session "
                         "%llu): wait for some to finish",
                         session.jobs.size(), (unsigned long long)session.max_jobs)};
  std::vector<Key> keys = checked_keys(request, slots_.num_slots(), worker->num_blocks);
  Namespace& ns = *index_.ns(worker->ns);
  std::unique_ptr<Job> job(new Job());
  job->id = request.job;
  job->kind = request.kind;
  job->session = &session;
  job->worker = worker;
  Transport* transport = transports[(int)worker->transport];
  transport->prepare(*worker, *job, request);
  if (tracing && received_ns) job->trace.push_back({0, received_ns});
  Submitted answer;
  if (request.kind == JobKind::STORE) {
    Index::Reservation r = index_.reserve_store(ns, worker->rank, keys.data(), keys.size(), request.job, worker->node,
                                                slots_.span(worker->block_bytes));
    for (auto& write : r.writes) {
      job->blocks.push_back(write.second);
      job->block_ids.push_back(request.block_ids[write.first]);
    }
    answer.already = job->already = r.already;
    answer.not_stored = job->not_stored = r.not_stored;
  } else {
    std::vector<uint32_t> sorted(request.block_ids);
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      throw Refusal{INVALID_ARGUMENT, "a load writes each block id once; the request repeats some"};
    job->blocks = index_.reserve_load(ns, keys.data(), keys.size(), worker->rank, worker->block_bytes);
    job->block_ids = request.block_ids;
    uint32_t from_disk = index_.take_promoted(job->blocks);
    if (from_disk) count(&session, ns, DISK_HIT_BLOCKS, from_disk);
  }
  for (uint32_t b : job->blocks) job->slots.push_back(index_.block(b).shards[worker->rank].slot);
  Job* started = job.release();
  begin(started);
  if (answer.not_stored)
    events_.log(WARNING, format("store job %llu of session %u: %u block(s) not stored, every slot is pinned",
                                (unsigned long long)request.job, session.number, answer.not_stored));
  return answer;
}

void Jobs::begin(Job* job) {
  int64_t now = now_ns();
  if (tracing) job->trace.push_back({1, now});
  job->submitted_ns = now;
  job->session->jobs[job->id] = job;
  (job->kind == JobKind::STORE ? store_clock : load_clock).start(now);
  in_flight++;
  job->worker->in_flight++;
  transports[(int)job->worker->transport]->start(*job);
}

std::vector<Transport*> Jobs::all_transports() const {
  std::vector<Transport*> out;
  for (Transport* t : transports)
    if (t) out.push_back(t);
  return out;
}

void Jobs::finish(std::vector<Ended>& ended) {
  for (Ended& e : ended) transports[(int)e.job->worker->transport]->ended(*e.job);
  std::vector<Ended*> told;
  for (Ended& e : ended)
    if (tell(e)) told.push_back(&e);
  replies_.flush();  // the clients hear first
  for (Ended* e : told) settle(*e);
}

bool Jobs::tell(Ended& e) {
  Job* job = e.job;
  Session& session = *job->session;
  if (session.ended && e.ok) {
    e.ok = false;
    e.error = "the client went away during the job";
  }
  auto found = session.jobs.find(job->id);
  if (found == session.jobs.end() || found->second != job) return false;
  session.jobs.erase(found);
  if (tracing) job->trace.push_back({9, now_ns()});
  if (!session.ended) {
    Submitted counts{job->already, job->not_stored};
    if (!replies_.job_done(session, job->id, e.ok, e.error, counts))
      events_.job_done(session.handle, job->id, e.ok, job->already, job->not_stored, e.error);
  }
  if (tracing) job->trace.push_back({10, now_ns()});
  return true;
}

void Jobs::settle(Ended& e) {
  Job* job = e.job;
  Session& session = *job->session;
  Worker& worker = *job->worker;
  if (session.recent.size() == RECENT_JOB_IDS) {
    session.recent_set.erase(session.recent.front());
    session.recent.pop_front();
  }
  session.recent.push_back(job->id);
  session.recent_set.insert(job->id);
  Namespace& ns = *index_.ns(worker.ns);
  uint64_t n = job->blocks.size(), nbytes = n * worker.block_bytes;
  int64_t now = now_ns();
  if (job->kind == JobKind::STORE) {
    index_.finish_stores(job->blocks, worker.rank, e.ok, worker.block_bytes,
                         job->hashes.size() == job->blocks.size() && !job->hashes.empty() ? &job->hashes : nullptr);
    if (e.ok) {
      count(&session, ns, STORED_BLOCKS, n);
      count(&session, ns, STORED_BYTES, nbytes);
    }
    store_clock.stop(now);
  } else {
    index_.finish_loads(job->blocks);
    if (e.ok) {
      count(&session, ns, LOADED_BLOCKS, n);
      count(&session, ns, LOADED_BYTES, nbytes);
    }
    load_clock.stop(now);
  }
  job_times.finished(job->kind, e.ok, (double)(now - job->submitted_ns) / 1e9, session.ended);
  if (!e.ok) {
    count(&session, ns, FAILED_JOBS, 1);
    events_.log(WARNING, format("%s job %llu of session %u failed: %s", job->kind == JobKind::STORE ? "store" : "load",
                                (unsigned long long)job->id, session.number, e.error.c_str()));
  }
  in_flight--;
  if (tracing) {
    job->trace.push_back({11, now_ns()});
    events_.trace(session.handle, job->id, job->kind, (uint32_t)n, job->trace);
  }
  worker.in_flight--;
  delete job;
  if (worker.closing && worker.in_flight == 0) copies_ended(worker);
  forget_if_done(&session);
}

}  // namespace kvd
