// The job socket's protobuf frames, decoded and encoded by hand: the lane
// reads two requests and writes four answers, and protobuf's C++ library is
// not something a fresh machine's compiler has. Field numbers are
// proto/kvdepot.proto's; tests/test_native_wire.py checks this against the
// protobuf runtime on generated and mangled frames.
#include "wire.h"

namespace kvd {

namespace {

// Nested groups upb follows before it gives up (its default depth limit).
constexpr int MAX_DEPTH = 100;

enum WireType : int { VARINT = 0, FIXED64 = 1, BYTES = 2, START_GROUP = 3, END_GROUP = 4, FIXED32 = 5 };

struct Reader {
  const uint8_t* p;
  const uint8_t* end;
  size_t left() const { return (size_t)(end - p); }
};

bool varint(Reader& r, uint64_t& value) {
  value = 0;
  for (int i = 0; i < 10; i++) {
    if (r.p == r.end) return false;
    uint8_t byte = *r.p++;
    value |= (uint64_t)(byte & 0x7f) << (7 * i);
    if (!(byte & 0x80)) return true;
  }
  return false;
}

bool tag(Reader& r, uint32_t& field, int& wire_type) {
  uint64_t t;
  if (!varint(r, t) || t > UINT32_MAX) return false;
  field = (uint32_t)(t >> 3);
  wire_type = (int)(t & 7);
  return field != 0 && wire_type <= FIXED32;
}

bool bytes(Reader& r, Reader& inner) {
  uint64_t length;
  if (!varint(r, length) || length > r.left() || length > INT32_MAX) return false;
  inner = Reader{r.p, r.p + length};
  r.p += length;
  return true;
}

bool skip(Reader& r, uint32_t field, int wire_type, int depth) {
  uint64_t ignored;
  Reader inner;
  switch (wire_type) {
    case VARINT:
      return varint(r, ignored);
    case FIXED64:
      if (r.left() < 8) return false;
      r.p += 8;
      return true;
    case FIXED32:
      if (r.left() < 4) return false;
      r.p += 4;
      return true;
    case BYTES:
      return bytes(r, inner);
    case START_GROUP:
      if (depth >= MAX_DEPTH) return false;
      for (;;) {
        uint32_t f;
        int wt;
        if (!tag(r, f, wt)) return false;
        if (wt == END_GROUP) return f == field;
        if (!skip(r, f, wt, depth + 1)) return false;
      }
    default:  // an end group with no start
      return false;
  }
}

bool text(Reader& r, std::string* out) {
  Reader inner;
  if (!bytes(r, inner) || !valid_utf8(inner.p, inner.left())) return false;
  if (out) out->assign(reinterpret_cast<const char*>(inner.p), inner.left());
  return true;
}

// JobSocketHello and StagingOffer: only checked (the lane refuses them).
bool check_session_message(Reader r, int depth) {
  while (r.p < r.end) {
    uint32_t field;
    int wt;
    if (!tag(r, field, wt)) return false;
    if (field == 1 && wt == BYTES) {
      if (!text(r, nullptr)) return false;
    } else if (!skip(r, field, wt, depth)) {
      return false;
    }
  }
  return true;
}

bool job_message(Reader r, Frame& f, bool store) {
  JobRequest& q = f.request;
  while (r.p < r.end) {
    uint32_t field;
    int wt;
    uint64_t v;
    if (!tag(r, field, wt)) return false;
    if (field == 1 && wt == BYTES) {
      if (!text(r, &f.session_id)) return false;
    } else if (field == 2 && wt == VARINT) {
      if (!varint(r, v)) return false;
      q.worker = (uint32_t)v;
    } else if (field == 3 && wt == VARINT) {
      if (!varint(r, v)) return false;
      q.job = v;
    } else if (field == 4 && wt == BYTES) {
      Reader key;
      if (!bytes(r, key)) return false;
      q.keys.push_back({key.p, key.left()});
    } else if (field == 5 && wt == VARINT) {
      if (!varint(r, v)) return false;
      q.block_ids.push_back((uint32_t)v);
    } else if (field == 5 && wt == BYTES) {  // packed
      Reader packed;
      if (!bytes(r, packed)) return false;
      while (packed.p < packed.end) {
        if (!varint(packed, v)) return false;
        q.block_ids.push_back((uint32_t)v);
      }
    } else if (store && field == 6 && wt == BYTES) {
      Reader event;
      if (!bytes(r, event)) return false;
      q.event = event.p;
      q.event_len = event.left();
    } else if (store && field == 7 && wt == VARINT) {
      if (!varint(r, v)) return false;
      q.fence_seq = v;
    } else if (!skip(r, field, wt, 0)) {
      return false;
    }
  }
  return true;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back((char)(v | 0x80));
    v >>= 7;
  }
  out.push_back((char)v);
}

void put_tag(std::string& out, uint32_t field, int wire_type) { put_varint(out, (uint64_t)field << 3 | wire_type); }

void put_message(std::string& out, uint32_t field, const std::string& body) {
  put_tag(out, field, BYTES);
  put_varint(out, body.size());
  out += body;
}

// A whole JobReply frame: the header, request_id, then field `field` = `body`.
void put_reply(std::string& out, uint64_t request_id, uint32_t field, const std::string& body) {
  std::string message;
  if (request_id) {
    put_tag(message, 1, VARINT);
    put_varint(message, request_id);
  }
  put_message(message, field, body);
  uint32_t length = (uint32_t)message.size();
  out.append(reinterpret_cast<const char*>(&length), 4);  // little-endian (x86-64, aarch64)
  out += message;
}

}  // namespace

bool decode_frame(const uint8_t* data, size_t size, Frame& f) {
  Reader r{data, data + size};
  while (r.p < r.end) {
    uint32_t field;
    int wt;
    if (!tag(r, field, wt)) return false;
    Reader inner;
    if (field == 1 && wt == VARINT) {
      if (!varint(r, f.request_id)) return false;
      continue;
    }
    if (field >= 2 && field <= 5 && wt == BYTES) {
      if (!bytes(r, inner)) return false;
      Frame::Kind kind = field == 2 ? Frame::HELLO : field == 3 ? Frame::STORE : field == 4 ? Frame::LOAD : Frame::STAGING;
      if (kind != f.kind) {  // another member of the oneof: the earlier one goes
        f.session_id.clear();
        f.request = JobRequest();
        f.kind = kind;
      }
      bool ok = kind == Frame::STORE || kind == Frame::LOAD ? job_message(inner, f, kind == Frame::STORE)
                                                           : check_session_message(inner, 0);
      if (!ok) return false;
      continue;
    }
    if (!skip(r, field, wt, 0)) return false;
  }
  f.request.kind = f.kind == Frame::LOAD ? JobKind::LOAD : JobKind::STORE;
  return true;
}

void reply_store_submitted(std::string& out, uint64_t request_id, const Submitted& counts) {
  std::string body;
  if (counts.already) {
    put_tag(body, 1, VARINT);
    put_varint(body, counts.already);
  }
  if (counts.not_stored) {
    put_tag(body, 2, VARINT);
    put_varint(body, counts.not_stored);
  }
  put_reply(out, request_id, 2, body);
}

void reply_load_submitted(std::string& out, uint64_t request_id) { put_reply(out, request_id, 3, std::string()); }

void reply_refused(std::string& out, uint64_t request_id, int code, const std::string& message) {
  std::string body;
  if (code) {
    put_tag(body, 1, VARINT);
    put_varint(body, (uint64_t)code);
  }
  if (!message.empty()) {
    put_tag(body, 2, BYTES);
    put_varint(body, message.size());
    body += message;
  }
  put_reply(out, request_id, 4, body);
}

void reply_job_done(std::string& out, uint64_t job_id, bool ok, const std::string& error, const Submitted& counts) {
  std::string body;
  if (job_id) {
    put_tag(body, 1, VARINT);
    put_varint(body, job_id);
  }
  if (ok) {
    put_tag(body, 2, VARINT);
    put_varint(body, 1);
  }
  if (!error.empty()) {
    put_tag(body, 3, BYTES);
    put_varint(body, error.size());
    body += error;
  }
  if (counts.already) {
    put_tag(body, 4, VARINT);
    put_varint(body, counts.already);
  }
  if (counts.not_stored) {
    put_tag(body, 5, VARINT);
    put_varint(body, counts.not_stored);
  }
  put_reply(out, 0, 5, body);
}

bool valid_utf8(const uint8_t* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) len = 2, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0) len = 3, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0) len = 4, cp = c & 0x07;
    else return false;
    if (i + len > n) return false;
    for (size_t k = 1; k < len; k++) {
      if ((s[i + k] & 0xC0) != 0x80) return false;
      cp = cp << 6 | (s[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += len;
  }
  return true;
}

}  // namespace kvd
