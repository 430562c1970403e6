// The router's token relay in C++ (router/native_relay.py loads it with the rest of the
// native gRPC library): a decode worker's Decode stream (csrc/grpc_calls.cc) read and its
// tokens sent on to the client's Generate stream (csrc/grpc_server.cc) as GenerateResponse
// deltas, with the text, stop strings, EOS and max_tokens handled as router/lifecycle.py's
// Completion does, and without waking Python per message.
//
// Text: only for tokenizers whose decode(ids, skip_special_tokens=True) is the UTF-8 of the
// ids' bytes joined, invalid bytes replaced (byte-level BPE; native_relay.py checks it), so a
// vocabulary is each token's bytes (none for a skipped special token). A token's text is
// sent once the bytes not yet sent decode without ending in U+FFFD, as the incremental
// detokenizer (router/detokenizer.py) sends it; stop strings are cut as its StopMatcher
// cuts them (on UTF-8 bytes, which for valid text and stop strings is the same).
//
//   pdr_vocab(bytes, offsets, n) -> vocab         token i: bytes[offsets[i]:offsets[i+1]]
//   pdr_new(vocab, request_id, max_tokens, tokens, eos, n_eos, stops, held) -> relay
//   pdr_accept(relay, ids, n, finish, &text, &len) -> taken   (no gRPC: what one message does)
//   pdr_run(relay, server_call, decode_call) -> outcome   (GIL released: it waits)
//   pdr_feed(relay, server_call, ids, n, finish) -> outcome or -1   (one message handed over)
//   pdr_tokens / pdr_finish_reason / pdr_sent / pdr_status, pdr_free, pdr_vocab_free

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

extern "C" {
void pdn_sink(void* call, int (*sink)(void*, const char*, size_t, int, int, const char*),
              void* context);
int pds_write(void* call, const char* data, size_t len);
}

namespace {

const char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

struct Vocab {
  std::string bytes;
  std::vector<uint32_t> offsets;  // n + 1
};

// `in` as UTF-8 with each maximal ill-formed subpart replaced by U+FFFD (Python's "replace"
// and Rust's from_utf8_lossy agree on this); an incomplete last character is one U+FFFD too.
std::string Lossy(const std::string& in) {
  std::string out;
  out.reserve(in.size());
  const auto* s = reinterpret_cast<const unsigned char*>(in.data());
  size_t n = in.size(), i = 0;
  while (i < n) {
    unsigned char b = s[i];
    if (b < 0x80) {
      out.push_back(static_cast<char>(b));
      ++i;
      continue;
    }
    size_t need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
      need = 1;
    } else if (b >= 0xE0 && b <= 0xEF) {
      need = 2;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      need = 3;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    } else {
      out.append(kReplacement);
      ++i;
      continue;
    }
    size_t j = i + 1;
    for (size_t k = 0; k < need && j < n; ++k, ++j) {
      unsigned char c = s[j];
      if (k == 0 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) break;
    }
    if (j - i == need + 1) {
      out.append(in, i, need + 1);
    } else {
      out.append(kReplacement);
    }
    i = j;
  }
  return out;
}

bool EndsWithReplacement(const std::string& s) {
  return s.size() >= 3 && s.compare(s.size() - 3, 3, kReplacement) == 0;
}

bool EndsWith(const std::string& s, const std::string& tail, size_t n) {
  return s.size() >= n && s.compare(s.size() - n, n, tail, 0, n) == 0;
}

void Varint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

void Bytes(std::string* out, int field, const std::string& s) {
  out->push_back(static_cast<char>(field << 3 | 2));
  Varint(out, s.size());
  out->append(s);
}

bool ReadVarint(const unsigned char*& p, const unsigned char* end, uint64_t* v) {
  *v = 0;
  for (int shift = 0; p < end && shift < 64; shift += 7) {
    unsigned char b = *p++;
    *v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

// A DecodeResponse's token_ids (field 1, packed or not) and finish_reason (field 2).
bool ParseDecodeResponse(const char* data, size_t len, std::vector<int32_t>* ids,
                         std::string* finish) {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  const auto* end = p + len;
  while (p < end) {
    uint64_t key, v;
    if (!ReadVarint(p, end, &key)) return false;
    int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    if (wire == 0) {
      if (!ReadVarint(p, end, &v)) return false;
      if (field == 1) ids->push_back(static_cast<int32_t>(v));
    } else if (wire == 2) {
      if (!ReadVarint(p, end, &v) || v > static_cast<uint64_t>(end - p)) return false;
      const auto* stop = p + v;
      if (field == 1) {
        while (p < stop) {
          uint64_t id;
          if (!ReadVarint(p, stop, &id)) return false;
          ids->push_back(static_cast<int32_t>(id));
        }
      } else if (field == 2) {
        finish->assign(reinterpret_cast<const char*>(p), v);
      }
      p = stop;
    } else if (wire == 1 || wire == 5) {
      size_t skip = wire == 1 ? 8 : 4;
      if (static_cast<size_t>(end - p) < skip) return false;
      p += skip;
    } else {
      return false;
    }
  }
  return true;
}

double Now() {  // CLOCK_MONOTONIC, as Python's time.monotonic()
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

enum Outcome {
  kRouterFinished = 0,  // EOS, a stop string or max_tokens, seen here: decode goes on
  kDecodeFinished = 1,  // decode ended the sequence ("stop", "length")
  kAborted = 2,         // decode aborted it
  kFailed = 3,          // the Decode call failed (pdr_status)
  kNoFinish = 4,        // the Decode call ended without a finish reason
  kClientGone = 5,      // the client's call is over: nothing more can be sent
  kBadMessage = 6,      // a Decode message that does not parse
};

class Relay {
 public:
  Relay(const Vocab* vocab, std::string request_id, int max_tokens, int tokens,
        std::unordered_set<int32_t> eos, std::vector<std::string> stops, std::string held)
      : vocab_(vocab), request_id_(std::move(request_id)), max_tokens_(max_tokens),
        tokens_(tokens), eos_(std::move(eos)), stops_(std::move(stops)), held_(std::move(held)) {}

  // What one Decode message does (Completion.accept, and .end on decode's finish): the
  // tokens taken into `taken_`, the text to send into `text_`. False: an abort.
  bool Accept(const std::vector<int32_t>& ids, const std::string& decode_finish) {
    taken_.clear();
    text_.clear();
    for (int32_t id : ids) {
      if (!finish_.empty()) break;
      taken_.push_back(id);
      ++tokens_;
      Push(id);
      if (eos_.count(id) || stopped_) finish_ = "stop";
      if (finish_.empty() && tokens_ >= max_tokens_) finish_ = "length";
    }
    if (!finish_.empty()) {
      Finish();
    } else if (!decode_finish.empty()) {
      if (decode_finish == "abort") return false;
      finish_ = decode_finish;
      Finish();
    }
    // A message with decode's finish ended the sequence there, whoever saw the end first.
    decode_finished_ = !decode_finish.empty();
    return true;
  }

  // Relay until the sequence ends, the call fails or the client is gone: each message is
  // taken on the decode call's own (driver) thread as it arrives (pdn_sink), this thread
  // waits for the outcome. Nothing waits for the client to read: what it has not read yet
  // is kept by its call instead of by the decode call.
  int Run(void* server, void* decode) {
    server_ = server;
    pdn_sink(decode, &Relay::Sink, this);
    std::unique_lock<std::mutex> lock(mu_);
    over_.wait(lock, [this] { return outcome_ >= 0; });
    return outcome_;
  }

  // One Decode message's tokens and finish, sent on: the outcome, or -1 to go on.
  int Deliver(const std::vector<int32_t>& ids, const std::string& decode_finish) {
    if (!Accept(ids, decode_finish)) return kAborted;
    if (!taken_.empty() || !text_.empty()) {
      Encode();
      if (pds_write(server_, out_.data(), out_.size()) < 0) return kClientGone;
      if (!taken_.empty()) {
        sent_at_.push_back(Now());
        sent_tokens_.push_back(static_cast<int32_t>(taken_.size()));
      }
    }
    if (!finish_.empty()) return decode_finished_ ? kDecodeFinished : kRouterFinished;
    return -1;
  }

  void set_server(void* server) { server_ = server; }
  const std::string& text() const { return text_; }
  const std::vector<int32_t>& taken() const { return taken_; }
  int tokens() const { return tokens_; }
  const std::string& finish_reason() const { return finish_; }
  const std::vector<double>& sent_at() const { return sent_at_; }
  const std::vector<int32_t>& sent_tokens() const { return sent_tokens_; }
  int status_code() const { return status_code_; }
  const std::string& status_details() const { return status_details_; }

 private:
  static int Sink(void* self, const char* data, size_t len, int end, int code,
                  const char* details) {
    auto* relay = static_cast<Relay*>(self);
    int outcome = relay->Take(data, len, end, code, details);
    if (outcome < 0) return 1;
    std::lock_guard<std::mutex> lock(relay->mu_);  // notified under it: Run's caller frees us
    relay->outcome_ = outcome;
    relay->over_.notify_all();
    return 0;
  }

  // One Decode message (or the call's end): the outcome, or -1 to go on.
  int Take(const char* data, size_t len, int end, int code, const char* details) {
    if (end) {
      status_code_ = code;
      status_details_ = details ? details : "";
      return code != 0 ? kFailed : kNoFinish;
    }
    ids_.clear();
    decode_finish_.clear();
    if (!ParseDecodeResponse(data, len, &ids_, &decode_finish_)) return kBadMessage;
    return Deliver(ids_, decode_finish_);
  }

  void Push(int32_t id) {  // OutputText.push: detokenize, then stop strings
    if (id >= 0 && static_cast<size_t>(id) + 1 < vocab_->offsets.size()) {
      uint32_t a = vocab_->offsets[id], b = vocab_->offsets[id + 1];
      pending_.append(vocab_->bytes, a, b - a);
    }
    if (pending_.empty()) return;
    std::string text = Lossy(pending_);
    if (EndsWithReplacement(text)) return;  // held: a character may be incomplete
    pending_.clear();
    Stop(text);
  }

  void Finish() {  // OutputText.finish: what is held, flushed
    std::string rest = Lossy(pending_);
    pending_.clear();
    Stop(rest);
    if (!stopped_) {
      text_ += held_;
      held_.clear();
    }
  }

  void Stop(const std::string& text) {  // StopMatcher.push
    if (stopped_) return;
    if (stops_.empty()) {
      text_ += text;
      return;
    }
    std::string buffer = held_ + text;
    size_t first = std::string::npos;
    for (const auto& stop : stops_) {
      size_t at = buffer.find(stop);
      if (at < first) first = at;
    }
    if (first != std::string::npos) {
      stopped_ = true;
      held_.clear();
      text_.append(buffer, 0, first);
      return;
    }
    size_t keep = 0;  // the longest tail that is a proper prefix of a stop string
    for (const auto& stop : stops_) {
      for (size_t n = std::min(stop.size() - 1, buffer.size()); n > keep; --n) {
        if (EndsWith(buffer, stop, n)) {
          keep = n;
          break;
        }
      }
    }
    held_.assign(buffer, buffer.size() - keep, keep);
    text_.append(buffer, 0, buffer.size() - keep);
  }

  void Encode() {  // GenerateResponse{request_id, delta: TokenDelta{text, token_ids}}
    std::string delta;
    if (!text_.empty()) Bytes(&delta, 1, text_);
    if (!taken_.empty()) {
      std::string packed;
      for (int32_t id : taken_) Varint(&packed, static_cast<uint64_t>(static_cast<int64_t>(id)));
      Bytes(&delta, 2, packed);
    }
    out_.clear();
    if (!request_id_.empty()) Bytes(&out_, 1, request_id_);
    Bytes(&out_, 2, delta);
  }

  const Vocab* vocab_;
  std::string request_id_;
  int max_tokens_, tokens_;
  std::unordered_set<int32_t> eos_;
  std::vector<std::string> stops_;
  std::string held_, pending_, finish_, text_, out_;
  std::vector<int32_t> taken_;
  bool stopped_ = false, decode_finished_ = false;
  std::vector<double> sent_at_;
  std::vector<int32_t> sent_tokens_;
  int status_code_ = 0;
  std::string status_details_;
  void* server_ = nullptr;
  std::vector<int32_t> ids_;
  std::string decode_finish_;
  std::mutex mu_;
  std::condition_variable over_;
  int outcome_ = -1;
};

}  // namespace

extern "C" {

void* pdr_vocab(const char* bytes, const uint32_t* offsets, int n) {
  auto* vocab = new Vocab;
  vocab->offsets.assign(offsets, offsets + n + 1);
  vocab->bytes.assign(bytes, offsets[n]);
  return vocab;
}

void pdr_vocab_free(void* vocab) { delete static_cast<Vocab*>(vocab); }

// `stops`: `n_stops` strings, NUL-free and non-empty, each preceded by its 4-byte length.
void* pdr_new(void* vocab, const char* request_id, int max_tokens, int tokens,
              const int32_t* eos, int n_eos, const char* stops, int n_stops,
              const char* held, size_t held_len) {
  std::vector<std::string> stop_list;
  const char* p = stops;
  for (int i = 0; i < n_stops; ++i) {
    uint32_t len;
    std::memcpy(&len, p, sizeof len);
    stop_list.emplace_back(p + sizeof len, len);
    p += sizeof len + len;
  }
  return new Relay(static_cast<Vocab*>(vocab), request_id, max_tokens, tokens,
                   std::unordered_set<int32_t>(eos, eos + n_eos), std::move(stop_list),
                   std::string(held, held_len));
}

void pdr_free(void* relay) { delete static_cast<Relay*>(relay); }

// One message's worth of Accept, for tests: the tokens taken (their count returned; the ids
// in `taken` up to `n`), the text to send; -1: an abort.
int pdr_accept(void* relay, const int32_t* ids, int n, const char* finish, int32_t* taken,
               const char** text, size_t* text_len) {
  auto* r = static_cast<Relay*>(relay);
  if (!r->Accept(std::vector<int32_t>(ids, ids + n), finish)) return -1;
  std::memcpy(taken, r->taken().data(), r->taken().size() * sizeof(int32_t));
  *text = r->text().data();
  *text_len = r->text().size();
  return static_cast<int>(r->taken().size());
}

int pdr_run(void* relay, void* server_call, void* decode_call) {
  return static_cast<Relay*>(relay)->Run(server_call, decode_call);
}

// One message handed over by the caller (the router's reader of a shared DecodeMany stream)
// and sent on to `server_call`: the outcome, or -1 to go on.
int pdr_feed(void* relay, void* server_call, const int32_t* ids, int n, const char* finish) {
  auto* r = static_cast<Relay*>(relay);
  r->set_server(server_call);
  return r->Deliver(std::vector<int32_t>(ids, ids + n), finish);
}

int pdr_tokens(void* relay) { return static_cast<Relay*>(relay)->tokens(); }

const char* pdr_finish_reason(void* relay) {
  return static_cast<Relay*>(relay)->finish_reason().c_str();
}

// The deltas with tokens sent: when (monotonic seconds) and how many tokens each.
int pdr_sent(void* relay, const double** at, const int32_t** tokens) {
  auto* r = static_cast<Relay*>(relay);
  *at = r->sent_at().data();
  *tokens = r->sent_tokens().data();
  return static_cast<int>(r->sent_at().size());
}

int pdr_status(void* relay, const char** details) {
  auto* r = static_cast<Relay*>(relay);
  *details = r->status_details().c_str();
  return r->status_code();
}

}  // extern "C"
