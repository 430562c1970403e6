// The router's calls to its workers on gRPC's C++ core (router/native_calls.py loads it with
// ctypes): unary and server-streaming calls of opaque (already serialized) messages.
//
// Every event of every call lands on one completion queue drained by one thread here; the
// Python thread that waits for a call blocks on that call's condition variable with the GIL
// released (ctypes releases it around every foreign call). A stream's messages are read
// ahead into the call as they arrive. A call is freed once both its Python handle has let
// go of it (pdn_free) and its last event has come back.
//
//   pdn_channel(target, options, root_pem, key_pem, cert_pem, tls) -> channel
//   pdn_start(channel, method, request, len, timeout_s, metadata, streaming) -> call
//   pdn_next(call, &data, &len)  1: a message (valid until the next pdn_next), 0: the end
//   pdn_status(call, &details)   the final status code (after pdn_next said 0)
//   pdn_cancel(call)             from any thread;   pdn_free(call), pdn_channel_free(channel)
//   pdn_sink(call, sink, context)  the messages to `sink` on the driver thread from now on

#include <absl/synchronization/mutex.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>

#include "grpc_options.h"

namespace {

grpc::CompletionQueue* queue = nullptr;
std::once_flag queue_started;

class Call;

// Where a call's messages go as they arrive (pdn_sink): (context, data, len, end, status code,
// details); returns 0 once it wants no more.
using Sink = int (*)(void*, const char*, size_t, int, int, const char*);

// What a completion-queue tag points at: which event of which call.
struct Op {
  enum Kind { kStart, kWrite, kRead, kFinish, kUnary };
  Call* call;
  Kind kind;
};

class Call {
 public:
  Call() : start_{this, Op::kStart}, write_{this, Op::kWrite}, read_{this, Op::kRead},
           finish_{this, Op::kFinish}, unary_{this, Op::kUnary} {}

  void StartStream(grpc::GenericStub* stub, const std::string& method) {
    stream_ = stub->PrepareCall(&context, method, queue);
    stream_->StartCall(&start_);
  }

  void StartUnary(grpc::GenericStub* stub, const std::string& method) {
    unary_call_ = stub->PrepareUnaryCall(&context, method, request, queue);
    unary_call_->StartCall();
    unary_call_->Finish(&in_, &status_, &unary_);
  }

  // The driver thread: one event of this call.
  void On(Op::Kind kind, bool ok) {
    switch (kind) {
      case Op::kStart:
        if (!ok) return Finish();
        writing_ = true;
        stream_->WriteLast(request, grpc::WriteOptions(), &write_);
        stream_->Read(&in_, &read_);
        return;
      case Op::kWrite:
        writing_ = false;
        if (read_over_) Finish();
        return;
      case Op::kRead:
        if (!ok) {
          read_over_ = true;
          if (!writing_) Finish();
          return;
        }
        Arrived(false);
        stream_->Read(&in_, &read_);
        return;
      case Op::kFinish:
        return Arrived(true);
      case Op::kUnary:
        if (status_.ok()) Arrived(false);
        return Arrived(true);
    }
  }

  // The waiting thread: the next message, or false at the end.
  bool Next(const char** data, size_t* len) {
    std::unique_lock<std::mutex> lock(mu_);
    ready_.wait(lock, [this] { return !messages_.empty() || done_; });
    if (messages_.empty()) return false;
    taken_ = std::move(messages_.front());
    messages_.pop_front();
    *data = taken_.data();
    *len = taken_.size();
    return true;
  }

  int Status(const char** details) {
    std::lock_guard<std::mutex> lock(mu_);
    details_ = status_.error_message();  // a copy in gRPC 1.51: kept for the caller
    *details = details_.c_str();
    return done_ ? status_.error_code() : -1;
  }

  // From now on each message (and the end) goes to `sink` on the driver thread as it
  // arrives, those already here first (on this thread); a sink that returns 0 is done, and
  // what comes after it is kept for pdn_next as before.
  void SetSink(Sink sink, void* context) {
    std::lock_guard<std::mutex> lock(mu_);
    sink_ = sink;
    sink_context_ = context;
    while (sink_ != nullptr && !messages_.empty()) {
      std::string message = std::move(messages_.front());
      messages_.pop_front();
      ToSink(message.data(), message.size());
    }
    if (sink_ != nullptr && done_) EndSink();
  }

  // One of the two owners (the Python handle, the driver) lets go.
  void Release() {
    bool last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = --owners_ == 0;
    }
    if (last) delete this;
  }

  bool Done() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

  grpc::ClientContext context;
  grpc::ByteBuffer request;

 private:
  void Finish() { stream_->Finish(&status_, &finish_); }

  void Arrived(bool end) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (end) {
        done_ = true;
        if (sink_ != nullptr) EndSink();
      } else {
        grpc::Slice slice;
        if (in_.DumpToSingleSlice(&slice).ok()) {
          const char* data = reinterpret_cast<const char*>(slice.begin());
          if (sink_ == nullptr) {
            messages_.emplace_back(data, slice.size());
          } else {
            ToSink(data, slice.size());
          }
        }
        in_.Clear();
      }
    }
    ready_.notify_all();
    if (end) Release();
  }

  void ToSink(const char* data, size_t len) {  // mu_ held
    if (!sink_(sink_context_, data, len, 0, 0, "")) sink_ = nullptr;
  }

  void EndSink() {  // mu_ held, done_ set: the status goes to the sink
    details_ = status_.error_message();
    sink_(sink_context_, nullptr, 0, 1, status_.error_code(), details_.c_str());
    sink_ = nullptr;
  }

  Op start_, write_, read_, finish_, unary_;
  Sink sink_ = nullptr;
  void* sink_context_ = nullptr;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream_;
  std::unique_ptr<grpc::ClientAsyncResponseReader<grpc::ByteBuffer>> unary_call_;
  grpc::ByteBuffer in_;
  grpc::Status status_;
  bool writing_ = false, read_over_ = false;  // the driver thread's alone
  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::string> messages_;
  std::string taken_, details_;
  bool done_ = false;
  int owners_ = 2;
};

void Drive() {
  void* tag;
  bool ok;
  while (queue->Next(&tag, &ok)) {
    Op* op = static_cast<Op*>(tag);
    op->call->On(op->kind, ok);
  }
}

void StartQueue() {
  // Debian's abseil checks every mutex for deadlock cycles: ~10% of a router's CPU.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  queue = new grpc::CompletionQueue;
  std::thread(Drive).detach();
}

struct Channel {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> stub;
};

}  // namespace

extern "C" {

// `options`: "key=value" lines (grpc_options.h).
void* pdn_channel(const char* target, const char* options, const char* root_pem,
                  const char* key_pem, const char* cert_pem, int tls) {
  std::call_once(queue_started, StartQueue);
  grpc::ChannelArguments args;
  pdserve::ForEachOption(options, [&args](const std::string& key, auto value) {
    if constexpr (std::is_same_v<decltype(value), int>) {
      args.SetInt(key, value);
    } else {
      args.SetString(key, value);
    }
  });
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = root_pem;
    ssl.pem_private_key = key_pem;
    ssl.pem_cert_chain = cert_pem;
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  auto* channel = new Channel;
  channel->channel = grpc::CreateCustomChannel(target, credentials, args);
  channel->stub = std::make_unique<grpc::GenericStub>(channel->channel);
  return channel;
}

void pdn_channel_free(void* channel) { delete static_cast<Channel*>(channel); }

// `metadata`: "key\nvalue\n" pairs. `timeout_s` <= 0: no deadline.
void* pdn_start(void* channel, const char* method, const char* request, size_t len,
                double timeout_s, const char* metadata, int streaming) {
  auto* call = new Call;
  if (timeout_s > 0) {
    call->context.set_deadline(std::chrono::system_clock::now() +
                               std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6)));
  }
  std::stringstream pairs(metadata);
  for (std::string key, value; std::getline(pairs, key) && std::getline(pairs, value);) {
    call->context.AddMetadata(key, value);
  }
  grpc::Slice slice(request, len);
  call->request = grpc::ByteBuffer(&slice, 1);
  auto* stub = static_cast<Channel*>(channel)->stub.get();
  if (streaming) {
    call->StartStream(stub, method);
  } else {
    call->StartUnary(stub, method);
  }
  return call;
}

int pdn_next(void* call, const char** data, size_t* len) {
  return static_cast<Call*>(call)->Next(data, len) ? 1 : 0;
}

int pdn_status(void* call, const char** details) {
  return static_cast<Call*>(call)->Status(details);
}

void pdn_cancel(void* call) { static_cast<Call*>(call)->context.TryCancel(); }

void pdn_sink(void* call, Sink sink, void* context) {
  static_cast<Call*>(call)->SetSink(sink, context);
}

void pdn_free(void* handle) {
  auto* call = static_cast<Call*>(handle);
  if (!call->Done()) call->context.TryCancel();  // its last event frees it
  call->Release();
}

}  // extern "C"
