// The job socket's connections once they have said hello (port of
// server/api/job_socket.py's JobConnection after its hello): the lane reads
// their frames, answers them and writes their JobDone, with the same bounds.
#pragma once

#include "wire.h"

namespace kvd {

class Conns : public Replies {
 public:
  // Why a connection ended, as Python logs it (rate-limited by kind).
  enum Closed : uint8_t { LOST = 0, DROPPED = 1, UNREAD = 2, CLOSED = 3 };

  Conns(int epoll_fd, Jobs& jobs, Events& events, uint64_t max_unread, uint64_t max_frame_bytes_per_uid);
  ~Conns();
  // Takes a connection that said hello: `fd` is the lane's from now on. `first`
  // goes out before anything else (the answer to hello); `leftover` holds
  // what was read after the hello.
  // `uid`: its peer's, from the kernel. `quiet`: submits taken get no answer
  // (proto: JobSocketHello.quiet_submits).
  uint32_t add(Session& session, int fd, const std::string& peer, uint32_t uid, const std::string& first,
               const std::string& leftover, bool quiet);
  // The session ended (or Python closes it): closes once its output is written.
  void close(uint32_t id);
  void on_epoll(uint32_t id, uint32_t events);
  bool job_done(Session& session, uint64_t job, bool ok, const std::string& error, const Submitted& counts) override;
  void flush() override;
  size_t size() const { return conns_.size(); }

 private:
  struct Conn {
    uint32_t id = 0;
    int fd = -1;
    uint32_t session = 0;
    std::string peer;
    uint32_t uid = 0;
    // The length of the frame not yet whole that counts against its uid's budget.
    uint32_t frame_held = 0;
    // Bytes received: [in_start, in_end) of `in`, whose size is the room to
    // receive into (kept between reads: growing it before each recv would
    // zero-fill READ_BYTES every time).
    std::string in;
    size_t in_start = 0, in_end = 0;
    std::string out;
    size_t out_start = 0;
    bool paused = false;   // its replies pile up unread: its requests wait
    bool closing = false;  // closes once its output is written
    bool dropped = false;  // for a frame it sent
    bool quiet = false;
    uint32_t interest = 0;
  };
  void read(Conn& c);
  void handle_frames(Conn& c);
  void answer(Conn& c, Frame& frame, int64_t received);
  void write(Conn& c);
  void update_interest(Conn& c);
  // Closes it once the answers before are written, with a warning (rate-limited by `why`).
  void drop(Conn& c, const char* why, const std::string& text);
  void end(Conn& c, Closed kind);
  // Counts a frame not yet whole against its uid's budget; past it, refuses and closes.
  void hold_frame(Conn& c, uint32_t length);
  void drop_frame(Conn& c);
  size_t unread(const Conn& c) const { return c.out.size() - c.out_start; }

  int epoll_fd_;
  Jobs& jobs_;
  Events& events_;
  uint64_t max_unread_;
  uint64_t max_frame_bytes_per_uid_;
  // Bytes of frames not yet whole that each uid's connections hold, by the
  // length the frames announce (server/api/job_gate.py Gate.frame_bytes).
  std::unordered_map<uint32_t, uint64_t> frame_bytes_;
  uint32_t next_id_ = 1;
  std::unordered_map<uint32_t, std::unique_ptr<Conn>> conns_;
  std::vector<uint32_t> dirty_;  // with output to write
};

}  // namespace kvd
