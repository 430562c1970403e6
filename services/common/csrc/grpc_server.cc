// A gRPC server on gRPC's C++ core whose methods Python threads answer
// (pdserve/common/native_server.py loads it with ctypes): every method served generically,
// requests and responses as serialized bytes.
//
// One thread drains the completion queue of every call's events. A Python thread takes an
// accepted call (its first request already read), reads any further requests, and writes its
// responses without waiting for them to be sent: the call keeps them in order and sends the
// next one when the last is out. (grpcio's server makes the handler's thread wait for every
// message it sends, two thread switches each: ~75 us of CPU a message here, ~14 us this way.)
//
// A call is freed when its owners are gone: the Python handle (pds_release), every operation
// still in the queue, and the `ended` queue's hold on a call the client cancelled.

#include <absl/synchronization/mutex.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "grpc_options.h"

namespace {

class Call;

struct Server {
  grpc::AsyncGenericService service;
  std::unique_ptr<grpc::ServerCompletionQueue> queue;
  std::unique_ptr<grpc::Server> server;
  std::thread driver;
  std::mutex mu;
  std::condition_variable accepted_cv, ended_cv;
  std::deque<Call*> accepted;  // read their first request, wait for a Python thread
  std::deque<Call*> ended;     // cancelled by the client while Python held them
  bool stopping = false;
};

struct Op {
  enum Kind { kAccept, kRead, kWrite, kFinish, kDone };
  Call* call;
  Kind kind;
};

void Append32(std::string* out, const std::string& s) {
  uint32_t n = static_cast<uint32_t>(s.size());
  out->append(reinterpret_cast<const char*>(&n), sizeof n);
  out->append(s);
}

class Call {
 public:
  explicit Call(Server* s)
      : server_(s), stream_(&context_), accept_{this, Op::kAccept}, read_{this, Op::kRead},
        write_{this, Op::kWrite}, finish_{this, Op::kFinish}, done_{this, Op::kDone} {
    owners_ = 2;  // the accept and the done notification
    context_.AsyncNotifyWhenDone(&done_);
    server_->service.RequestCall(&context_, &stream_, server_->queue.get(),
                                 server_->queue.get(), &accept_);
  }

  // --- the driver thread ---
  void On(Op::Kind kind, bool ok) {
    std::unique_lock<std::mutex> lock(mu_);
    switch (kind) {
      case Op::kAccept:
        if (ok) {  // else shutting down: this call never started
          new Call(server_);  // the next call waits while this one is served
          StartRead();
        }
        break;
      case Op::kRead:
        reading_ = false;
        if (ok) {
          grpc::Slice slice;
          if (in_.DumpToSingleSlice(&slice).ok()) {
            inbox_.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
          }
          in_.Clear();
        } else {
          read_end_ = true;
        }
        if (!handed_) {
          handed_ = true;
          ++owners_;  // the Python handle
          lock.unlock();
          {
            std::lock_guard<std::mutex> s(server_->mu);
            server_->accepted.push_back(this);
          }
          server_->accepted_cv.notify_one();
          lock.lock();
        }
        break;
      case Op::kWrite:
        writing_ = false;
        out_.pop_front();
        if (!ok) out_.clear();  // the client is gone: nothing more will be sent
        SendNext();
        break;
      case Op::kFinish:
        break;
      case Op::kDone:
        done_seen_ = true;
        if (context_.IsCancelled() && handed_ && !finish_asked_) {
          ++owners_;  // the ended queue's
          lock.unlock();
          {
            std::lock_guard<std::mutex> s(server_->mu);
            server_->ended.push_back(this);
          }
          server_->ended_cv.notify_one();
          lock.lock();
        }
        break;
    }
    ready_.notify_all();
    ReleaseLocked(lock);
  }

  // --- Python threads ---
  void Describe(const char** method, const char** meta, size_t* meta_len, const char** peer,
                double* remaining_s) {
    std::lock_guard<std::mutex> lock(mu_);
    method_ = context_.method();
    meta_.clear();
    for (const auto& [key, value] : context_.client_metadata()) {
      Append32(&meta_, std::string(key.data(), key.size()));
      Append32(&meta_, std::string(value.data(), value.size()));
    }
    peer_ = context_.peer();
    *method = method_.c_str();
    *meta = meta_.data();
    *meta_len = meta_.size();
    *peer = peer_.c_str();
    auto left = context_.deadline() - std::chrono::system_clock::now();
    double s = std::chrono::duration<double>(left).count();
    *remaining_s = s > 1e9 ? -1.0 : s;  // -1: no deadline
  }

  const char* Identities() {
    std::lock_guard<std::mutex> lock(mu_);
    identities_.clear();
    auto auth = context_.auth_context();
    if (auth) {
      for (const auto& id : auth->GetPeerIdentity()) {
        identities_.append(id.data(), id.size());
        identities_.push_back('\n');
      }
    }
    return identities_.c_str();
  }

  // 1: a request (valid until the next Read), 0: no more.
  int Read(const char** data, size_t* len) {
    std::unique_lock<std::mutex> lock(mu_);
    while (inbox_.empty() && !read_end_ && !done_seen_) {
      if (!reading_) StartRead();
      ready_.wait(lock);
    }
    if (inbox_.empty()) return 0;
    taken_ = std::move(inbox_.front());
    inbox_.pop_front();
    *data = taken_.data();
    *len = taken_.size();
    return 1;
  }

  // The responses queued now, this one included; -1: the call is over (cancelled or
  // finished), nothing more can be sent.
  int Write(const char* data, size_t len) {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_seen_ || finish_asked_) return -1;
    grpc::Slice slice(data, len);
    out_.emplace_back(&slice, 1);
    if (!writing_) SendNext();
    return static_cast<int>(out_.size());
  }

  // Wait until fewer than `n` responses are queued (a client reading slower than the handler
  // writes holds the handler back, as grpcio's server does); 0 once the call is over.
  int WaitBelow(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    ready_.wait(lock, [this, n] { return static_cast<int>(out_.size()) < n || done_seen_; });
    return done_seen_ ? 0 : 1;
  }

  void Finish(int code, const char* details) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finish_asked_) return;
    finish_asked_ = true;
    status_ = grpc::Status(static_cast<grpc::StatusCode>(code), details);
    if (!writing_) SendNext();
  }

  int Active() {
    std::lock_guard<std::mutex> lock(mu_);
    return !done_seen_ && !finish_asked_;
  }

  void Cancel() { context_.TryCancel(); }

  void Release() {
    std::unique_lock<std::mutex> lock(mu_);
    ReleaseLocked(lock);
  }

 private:
  void StartRead() {
    reading_ = true;
    ++owners_;
    stream_.Read(&in_, &read_);
  }

  // The next queued response, else the status once it is asked for (lock held).
  void SendNext() {
    if (done_seen_) {  // over (cancelled, or the server stopped): nothing may start now
      out_.clear();
      return;
    }
    if (writing_ || finish_started_) return;
    if (!out_.empty()) {
      writing_ = true;
      ++owners_;
      stream_.Write(out_.front(), &write_);
    } else if (finish_asked_) {
      finish_started_ = true;
      ++owners_;
      stream_.Finish(status_, &finish_);
    }
  }

  void ReleaseLocked(std::unique_lock<std::mutex>& lock) {
    if (--owners_ > 0) return;
    lock.unlock();
    delete this;
  }

  Server* server_;
  grpc::GenericServerContext context_;
  grpc::GenericServerAsyncReaderWriter stream_;
  Op accept_, read_, write_, finish_, done_;
  std::mutex mu_;
  std::condition_variable ready_;
  int owners_ = 0;
  bool handed_ = false, reading_ = false, read_end_ = false;
  bool writing_ = false, finish_asked_ = false, finish_started_ = false, done_seen_ = false;
  grpc::ByteBuffer in_;
  std::deque<std::string> inbox_;
  std::string taken_;
  std::deque<grpc::ByteBuffer> out_;
  grpc::Status status_;
  std::string method_, meta_, peer_, identities_;
};

void Drive(Server* s) {
  void* tag;
  bool ok;
  while (s->queue->Next(&tag, &ok)) {
    Op* op = static_cast<Op*>(tag);
    op->call->On(op->kind, ok);
  }
}

}  // namespace

extern "C" {

// `options`: "key=value" lines (grpc_options.h).
// TLS when `cert_pem` is not empty; `client_auth`: 0 none, 1 request and verify a client
// certificate (against `ca_pem`), 2 require and verify one. The port bound (0: it could not
// be) goes to *port; NULL when the server could not start.
void* pds_start(const char* address, const char* options, const char* cert_pem,
                const char* key_pem, const char* ca_pem, int client_auth, int* port) {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  auto* s = new Server;
  grpc::ServerBuilder builder;
  pdserve::ForEachOption(options, [&builder](const std::string& key, auto value) {
    builder.AddChannelArgument(key, value);
  });
  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (cert_pem[0] != '\0') {
    grpc::SslServerCredentialsOptions ssl(
        client_auth == 2 ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
        : client_auth == 1 ? GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY
                           : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    ssl.pem_root_certs = ca_pem;
    ssl.pem_key_cert_pairs.push_back({key_pem, cert_pem});
    credentials = grpc::SslServerCredentials(ssl);
  } else {
    credentials = grpc::InsecureServerCredentials();
  }
  *port = 0;
  builder.AddListeningPort(address, credentials, port);
  builder.RegisterAsyncGenericService(&s->service);
  s->queue = builder.AddCompletionQueue();
  s->server = builder.BuildAndStart();
  if (!s->server || *port == 0) {
    if (s->server) s->server->Shutdown();
    s->queue->Shutdown();
    void* tag;
    bool ok;
    while (s->queue->Next(&tag, &ok)) {
    }
    delete s;
    return nullptr;
  }
  for (int i = 0; i < 4; ++i) new Call(s);  // a few accepts waiting: bursts of new calls
  s->driver = std::thread(Drive, s);
  return s;
}

// The next accepted call, NULL once the server stops.
void* pds_accept(void* server) {
  auto* s = static_cast<Server*>(server);
  std::unique_lock<std::mutex> lock(s->mu);
  s->accepted_cv.wait(lock, [s] { return !s->accepted.empty() || s->stopping; });
  if (s->accepted.empty()) return nullptr;
  Call* call = s->accepted.front();
  s->accepted.pop_front();
  return call;
}

// The next call the client cancelled while Python held it (pds_release it once its
// callbacks ran), NULL once the server stops.
void* pds_next_ended(void* server) {
  auto* s = static_cast<Server*>(server);
  std::unique_lock<std::mutex> lock(s->mu);
  s->ended_cv.wait(lock, [s] { return !s->ended.empty() || s->stopping; });
  if (s->ended.empty()) return nullptr;
  Call* call = s->ended.front();
  s->ended.pop_front();
  return call;
}

// Stop: new calls refused, those in flight get `grace_s`, then are cancelled.
void pds_stop(void* server, double grace_s) {
  auto* s = static_cast<Server*>(server);
  s->server->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::microseconds(static_cast<int64_t>(grace_s * 1e6)));
  s->queue->Shutdown();
  if (s->driver.joinable()) s->driver.join();
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->stopping = true;
  }
  s->accepted_cv.notify_all();
  s->ended_cv.notify_all();
}

void pds_describe(void* call, const char** method, const char** meta, size_t* meta_len,
                  const char** peer, double* remaining_s) {
  static_cast<Call*>(call)->Describe(method, meta, meta_len, peer, remaining_s);
}
const char* pds_identities(void* call) { return static_cast<Call*>(call)->Identities(); }
int pds_read(void* call, const char** data, size_t* len) {
  return static_cast<Call*>(call)->Read(data, len);
}
int pds_write(void* call, const char* data, size_t len) {
  return static_cast<Call*>(call)->Write(data, len);
}
int pds_wait_below(void* call, int n) { return static_cast<Call*>(call)->WaitBelow(n); }
void pds_finish(void* call, int code, const char* details) {
  static_cast<Call*>(call)->Finish(code, details);
}
int pds_active(void* call) { return static_cast<Call*>(call)->Active(); }
void pds_cancel(void* call) { static_cast<Call*>(call)->Cancel(); }
void pds_release(void* call) { static_cast<Call*>(call)->Release(); }

}  // extern "C"
