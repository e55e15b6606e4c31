// The job socket's frames (proto/kvdepot.proto, "job socket"): JobFrame in,
// JobReply out, for the requests the lane serves after a connection's hello.
// The client's bytes are untrusted: every length is checked against what is
// left before it is used, and a frame that protobuf would refuse to parse is
// refused here (what upb does: unknown fields and wrong wire types skipped,
// a oneof's last member kept, a message field given twice merged, string
// fields valid UTF-8).
#pragma once

#include "jobs.h"

namespace kvd {

struct Frame {
  enum Kind : uint8_t { NONE = 0, HELLO, STORE, LOAD, STAGING };
  uint64_t request_id = 0;
  Kind kind = NONE;
  std::string session_id;  // of a store or load
  JobRequest request;
};

// Decodes one frame's bytes (which must outlive `frame`: keys point into
// them); false when they are not a JobFrame.
bool decode_frame(const uint8_t* data, size_t size, Frame& frame);

// JobReply messages, each as a whole frame (length, then the message).
void reply_store_submitted(std::string& out, uint64_t request_id, const Submitted& counts);
void reply_load_submitted(std::string& out, uint64_t request_id);
void reply_refused(std::string& out, uint64_t request_id, int code, const std::string& message);
void reply_job_done(std::string& out, uint64_t job_id, bool ok, const std::string& error, const Submitted& counts);

bool valid_utf8(const uint8_t* data, size_t size);

}  // namespace kvd
