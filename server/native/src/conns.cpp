// The job socket's connections after hello (port of server/api/job_socket.py):
// frames are read and answered in order, the answers to one read and the
// JobDone of jobs that end together go out in one write, and what a client can
// make the daemon hold is bounded as there: past PAUSE_AT bytes of replies it
// leaves unread its requests wait, past --max-unread-job-replies it is closed.
#include "conns.h"

#include <errno.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace kvd {

namespace {
constexpr size_t PAUSE_AT = 256 << 10;
constexpr size_t RESUME_AT = 64 << 10;
constexpr size_t READ_BYTES = 256 << 10;
// Reads of one connection per service call, so that one busy client cannot
// keep the others waiting.
constexpr int READS_PER_TURN = 8;
// A connection's room to receive into past which, once what it holds is
// small, it is given back.
constexpr size_t SHRINK_ABOVE = 4 * READ_BYTES;
}  // namespace

Conns::Conns(int epoll_fd, Jobs& jobs, Events& events, uint64_t max_unread, uint64_t max_frame_bytes_per_uid)
    : epoll_fd_(epoll_fd),
      jobs_(jobs),
      events_(events),
      max_unread_(max_unread),
      max_frame_bytes_per_uid_(max_frame_bytes_per_uid) {}

Conns::~Conns() {
  for (auto& entry : conns_)
    if (entry.second->fd >= 0) ::close(entry.second->fd);
}

uint32_t Conns::add(Session& session, int fd, const std::string& peer, uint32_t uid, const std::string& first,
                    const std::string& leftover, bool quiet) {
  auto owned = std::make_unique<Conn>();
  Conn& c = *owned;
  c.id = next_id_++;
  c.fd = fd;
  c.session = session.handle;
  c.peer = peer;
  c.uid = uid;
  c.out = first;
  c.in = leftover;
  c.in_end = leftover.size();
  c.quiet = quiet;
  conns_[c.id] = std::move(owned);
  session.conn = (int32_t)c.id;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = c.id;
  c.interest = EPOLLIN;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    events_.log(ERROR, format("the lane cannot watch the job socket connection of %s: %s", peer.c_str(), strerror(errno)));
    end(c, LOST);
    return c.id;
  }
  handle_frames(c);
  dirty_.push_back(c.id);
  return c.id;
}

void Conns::close(uint32_t id) {
  auto found = conns_.find(id);
  if (found == conns_.end() || found->second->fd < 0) return;
  found->second->closing = true;
  write(*found->second);
}

void Conns::on_epoll(uint32_t id, uint32_t events) {
  auto found = conns_.find(id);
  if (found == conns_.end()) return;
  Conn& c = *found->second;
  if (c.fd < 0) return;
  if ((events & EPOLLIN) && !c.paused && !c.closing) read(c);
  if (c.fd >= 0 && (events & EPOLLOUT)) write(c);
  if (c.fd >= 0 && (events & (EPOLLHUP | EPOLLERR)) && !(events & EPOLLIN)) end(c, LOST);
}

void Conns::read(Conn& c) {
  for (int round = 0; round < READS_PER_TURN && c.fd >= 0 && !c.paused && !c.closing; round++) {
    if (c.in.size() - c.in_end < READ_BYTES) {
      // What is left is at most a frame not yet whole: moved to the front,
      // so that the room stays a frame and a read at most.
      std::memmove(&c.in[0], c.in.data() + c.in_start, c.in_end - c.in_start);
      c.in_end -= c.in_start;
      c.in_start = 0;
      if (c.in.size() - c.in_end < READ_BYTES) c.in.resize(c.in_end + READ_BYTES);
    }
    ssize_t n = recv(c.fd, &c.in[c.in_end], READ_BYTES, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) end(c, LOST);
      return;
    }
    if (n == 0) {
      end(c, LOST);
      return;
    }
    c.in_end += (size_t)n;
    handle_frames(c);
    if (c.fd >= 0) write(c);
    if ((size_t)n < READ_BYTES) return;
  }
}

void Conns::handle_frames(Conn& c) {
  while (c.fd >= 0 && !c.paused && !c.closing) {
    if (unread(c) > PAUSE_AT) {
      // Its answers wait to be read first: a read's worth of small frames
      // would otherwise make ten times their size in answers.
      c.paused = true;
      break;
    }
    size_t available = c.in_end - c.in_start;
    if (available < 4) break;
    uint32_t length;
    std::memcpy(&length, c.in.data() + c.in_start, 4);
    if (length > MAX_JOB_FRAME_BYTES) {
      drop(c, "too large", format("closing a job socket connection that sent a frame of %u bytes (the limit is %u) (%s)",
                                  length, MAX_JOB_FRAME_BYTES, c.peer.c_str()));
      return;
    }
    if (available < 4 + (size_t)length) {
      // A frame that fits the room of a read is bounded by the connection
      // count already; a longer one counts from when its header came.
      if (length > READ_BYTES && c.frame_held == 0) hold_frame(c, length);
      break;
    }
    if (c.frame_held != 0) drop_frame(c);
    int64_t received = jobs_.tracing ? now_ns() : 0;
    Frame frame;
    const uint8_t* data = reinterpret_cast<const uint8_t*>(c.in.data()) + c.in_start + 4;
    if (!decode_frame(data, length, frame)) {
      drop(c, "undecodable",
           format("closing a job socket connection that sent a frame that is not a JobFrame (%s)", c.peer.c_str()));
      return;
    }
    answer(c, frame, received);  // the frame's keys point into c.in: consumed after
    c.in_start += 4 + (size_t)length;
  }
  if (c.in_start == c.in_end) c.in_start = c.in_end = 0;
  if (c.in.size() > SHRINK_ABOVE && c.in_end - c.in_start < c.in.size() / 4) {
    // The room a big frame took is given back once it is handled: hundreds
    // of connections each keeping 64 MiB would add up to many GiB.
    std::string(c.in, c.in_start, c.in_end - c.in_start).swap(c.in);
    c.in_end -= c.in_start;
    c.in_start = 0;
  }
}

void Conns::hold_frame(Conn& c, uint32_t length) {
  uint64_t& held = frame_bytes_[c.uid];
  if (held + length <= max_frame_bytes_per_uid_) {
    held += length;
    c.frame_held = length;
    return;
  }
  std::string why = format(
      "user id %u's job socket connections hold %llu bytes of frames not yet whole; a frame of %u more would pass "
      "the limit per user, %llu (--max-job-frame-bytes-per-uid)",
      c.uid, (unsigned long long)held, length, (unsigned long long)max_frame_bytes_per_uid_);
  if (held == 0) frame_bytes_.erase(c.uid);
  reply_refused(c.out, 0, RESOURCE_EXHAUSTED, why);
  drop(c, "frame budget", format("closing the job socket connection of %s: %s", c.peer.c_str(), why.c_str()));
}

void Conns::drop_frame(Conn& c) {
  auto found = frame_bytes_.find(c.uid);
  if (found != frame_bytes_.end() && (found->second -= c.frame_held) == 0) frame_bytes_.erase(found);
  c.frame_held = 0;
}

void Conns::answer(Conn& c, Frame& frame, int64_t received) {
  dirty_.push_back(c.id);
  static const char* names[] = {"", "hello", "submit_store", "submit_load", "staging"};
  try {
    Session* session = jobs_.session(c.session);
    if (session == nullptr) throw Refusal{UNAVAILABLE, "the session has ended"};
    switch (frame.kind) {
      case Frame::STORE:
      case Frame::LOAD: {
        if (frame.session_id != session->id)
          throw Refusal{INVALID_ARGUMENT, format("this job socket connection belongs to session %u, not to the one named",
                                                 session->number)};
        Submitted submitted = jobs_.submit(*session, frame.request, received);
        if (c.quiet) return;
        if (frame.kind == Frame::STORE) reply_store_submitted(c.out, frame.request_id, submitted);
        else reply_load_submitted(c.out, frame.request_id);
        return;
      }
      case Frame::HELLO:
      case Frame::STAGING:
        throw Refusal{FAILED_PRECONDITION,
                      format("%s must be the first frame of a job socket connection", names[frame.kind])};
      default:
        throw Refusal{INVALID_ARGUMENT, "an empty JobFrame: set one of its requests"};
    }
  } catch (Refusal& r) {
    reply_refused(c.out, frame.request_id, r.code, r.message);
  } catch (std::exception& e) {
    // A bug of the lane's, but one a client may trigger at will.
    events_.log(ERROR, format("job socket %s failed: %s", names[frame.kind], e.what()));
    reply_refused(c.out, frame.request_id, INTERNAL,
                  format("%s failed: see the daemon's log (%s)", names[frame.kind], e.what()));
  }
}

void Conns::write(Conn& c) {
  for (int rounds = 0; c.fd >= 0; rounds++) {
    while (c.out_start < c.out.size()) {
      ssize_t n = send(c.fd, c.out.data() + c.out_start, c.out.size() - c.out_start, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        end(c, LOST);
        return;
      }
      c.out_start += (size_t)n;
    }
    if (c.out_start == c.out.size()) {
      if (c.out.capacity() > SHRINK_ABOVE) std::string().swap(c.out);
      else c.out.clear();
      c.out_start = 0;
    } else if (c.out_start > (1 << 20)) {
      c.out.erase(0, c.out_start);
      c.out_start = 0;
    }
    size_t left = unread(c);
    if (left > max_unread_) {
      // What it did not read goes with it.
      events_.log(WARNING,
                  format("closing the job socket connection of %s: it left %zu bytes of replies unread (the limit is "
                         "%llu, --max-unread-job-replies)",
                         c.peer.c_str(), left, (unsigned long long)max_unread_),
                  "unread");
      end(c, UNREAD);
      return;
    }
    if (c.closing && left == 0) {
      end(c, c.dropped ? DROPPED : CLOSED);
      return;
    }
    if (!c.paused && left > PAUSE_AT) {
      c.paused = true;
    } else if (c.paused && left <= RESUME_AT && rounds < 4) {
      // It reads again: the requests that waited are served, and answered.
      c.paused = false;
      handle_frames(c);
      continue;
    }
    break;
  }
  if (c.fd >= 0) update_interest(c);
}

void Conns::update_interest(Conn& c) {
  // A paused connection wants EPOLLOUT even with nothing unread: write()
  // then resumes it (it stays paused when write() has looped enough).
  uint32_t want = (!c.paused && !c.closing ? (uint32_t)EPOLLIN : 0u) | (unread(c) || c.paused ? (uint32_t)EPOLLOUT : 0u);
  if (want == c.interest) return;
  epoll_event ev{};
  ev.events = want;
  ev.data.u64 = c.id;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.fd, &ev);
  c.interest = want;
}

void Conns::drop(Conn& c, const char* why, const std::string& text) {
  // The answers to the frames before this one still go out, then it closes.
  events_.log(WARNING, text, why);
  c.closing = true;
  c.dropped = true;
  write(c);
}

void Conns::end(Conn& c, Closed kind) {
  if (c.frame_held != 0) drop_frame(c);
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c.fd, nullptr);
  ::close(c.fd);
  c.fd = -1;
  Session* session = jobs_.session(c.session);
  if (session != nullptr && session->conn == (int32_t)c.id) session->conn = -1;
  events_.conn_closed(c.id, c.session, kind);
  dirty_.push_back(c.id);  // erased in flush
}

bool Conns::job_done(Session& session, uint64_t job, bool ok, const std::string& error, const Submitted& counts) {
  if (session.conn < 0) return false;
  auto found = conns_.find((uint32_t)session.conn);
  if (found == conns_.end() || found->second->fd < 0 || found->second->closing) return false;
  reply_job_done(found->second->out, job, ok, error, counts);
  dirty_.push_back(found->second->id);
  return true;
}

void Conns::flush() {
  std::vector<uint32_t> dirty;
  dirty.swap(dirty_);
  for (uint32_t id : dirty) {
    auto found = conns_.find(id);
    if (found == conns_.end()) continue;
    if (found->second->fd >= 0) write(*found->second);
    if (found->second->fd < 0) conns_.erase(found);
  }
}

}  // namespace kvd
