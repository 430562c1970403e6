// The least a native (C++ gRPC) router can do per request: the native kind of
// `pdserve bench router --floor`, beside the Python floors of pdserve.bench.router_floor.
//
//   router_floor --port P --prefill A,B --decode C,D [--max-streams 256]
//                [--stream-interval 1] [--remote-prefill-min-tokens 0]
//
// It serves Router.Generate (token ids only) exactly as the Python floors do: Reserve on a
// decode worker, Prefill with its ticket on a prefill worker, the Decode stream, its tokens
// relayed as they come (N to a message), the Timing and the Finish (a shorter prompt than
// --remote-prefill-min-tokens: prefilled on the decode worker, no Prefill call); workers taken
// in turn; streams beyond
// --max-streams refused with RESOURCE_EXHAUSTED; a worker's error passed on with its code.
//
// One thread drives everything through one completion queue (the server's and every client
// call's events): no lock, no hand-off between threads. gRPC's callback API, tried first,
// cost ~75 context switches a request here (its reactions run on a pool of threads); this is
// what a router data plane outside Python would pay for the same calls and messages.

#include <absl/synchronization/mutex.h>
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "health.grpc.pb.h"
#include "pdserve/v1/decode.grpc.pb.h"
#include "pdserve/v1/prefill.grpc.pb.h"
#include "pdserve/v1/router.grpc.pb.h"

namespace pb = pdserve::v1;

namespace {

constexpr double kLeaseMs = 30000.0;
constexpr int kTimeoutS = 30;
const char kBusy[] = "the floor router is serving its limit of Generate streams";

std::vector<std::string> Split(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::chrono::system_clock::time_point Deadline() {
  return std::chrono::system_clock::now() + std::chrono::seconds(kTimeoutS);
}

// What a completion-queue tag points at.
struct Event {
  virtual void Fire(bool ok) = 0;

 protected:
  ~Event() = default;
};

class Call;

// A step of a Generate call: which step of which call an event finishes.
struct Tag final : Event {
  Tag(Call* c, void (Call::*s)(bool)) : call(c), step(s) {}
  void Fire(bool ok) override;
  Call* call;
  void (Call::*step)(bool ok);
};

struct Router {
  pb::Router::AsyncService service;
  grpc::health::v1::Health::AsyncService health;
  std::unique_ptr<grpc::ServerCompletionQueue> cq;
  std::vector<std::unique_ptr<pb::Prefill::Stub>> prefill;
  std::vector<std::unique_ptr<pb::Decode::Stub>> decode;
  uint64_t next = 0;
  int free_streams = 0;
  int stream_interval = 1;  // tokens per Decode message after the first (the workers hold them)
  int here_below = 0;       // shorter prompts prefill on the decode worker (0: none)
};

// One Generate, from the moment the server is ready to accept it until its last event.
class Call {
 public:
  explicit Call(Router* r) : r_(r), writer_(&server_ctx_) {
    server_ctx_.AsyncNotifyWhenDone(Issue(&done_));
    r_->service.RequestGenerate(&server_ctx_, &request_, &writer_, r_->cq.get(), r_->cq.get(),
                                Issue(&accepted_));
  }

  // The queue's one thread: run a step, then delete the call once nothing is pending.
  static void Run(Tag* tag, bool ok) {
    Call* call = tag->call;
    --call->pending_;
    (call->*(tag->step))(ok);
    if (call->pending_ == 0) delete call;
  }

 private:
  void* Issue(Tag* tag) {
    ++pending_;
    return tag;
  }

  void Accepted(bool ok) {
    if (!ok) return;  // shutting down
    new Call(r_);     // the next one waits while this one runs
    if (r_->free_streams <= 0) {
      return End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, kBusy));
    }
    --r_->free_streams;
    counted_ = true;
    uint64_t i = r_->next++;
    prefill_ = r_->prefill[i % r_->prefill.size()].get();
    decode_ = r_->decode[i % r_->decode.size()].get();
    rid_ = request_.request_id().empty() ? "floor" + std::to_string(i) : request_.request_id();
    sampling_.set_temperature(0.0f);
    sampling_.set_ignore_eos(true);
    sampling_.set_max_tokens(request_.has_max_tokens() ? request_.max_tokens() : 8);
    pb::ReserveRequest reserve;
    reserve.set_request_id(rid_);
    reserve.set_num_prompt_tokens(request_.token_ids_size());
    reserve.set_lease_ms(kLeaseMs);
    *reserve.mutable_prompt_token_ids() = request_.token_ids();
    reserve.set_prefill_here_below_tokens(r_->here_below);
    *reserve.mutable_sampling() = sampling_;
    Client(&reserve_ctx_);
    reserve_ = decode_->AsyncReserve(&reserve_ctx_, reserve, r_->cq.get());
    reserve_->Finish(&held_, &status_, Issue(&reserved_));
  }

  void Reserved(bool) {
    client_ = nullptr;
    if (!status_.ok()) return End(status_);
    if (held_.prefilling_here()) {  // its first message brings the first token, then Timing
      here_ = true;
      pb::DecodeRequest decode;
      *decode.mutable_ticket() = held_.ticket();
      *decode.mutable_prompt_token_ids() = request_.token_ids();
      decode.set_local_prefill(true);
      return OpenDecode(std::move(decode));
    }
    pb::PrefillRequest prefill;
    prefill.set_request_id(rid_);
    *prefill.mutable_token_ids() = request_.token_ids();
    *prefill.mutable_sampling() = sampling_;
    *prefill.mutable_ticket() = held_.ticket();
    *prefill.mutable_destination() = held_.destination();
    Client(&prefill_ctx_);
    prefill_rpc_ = prefill_->AsyncPrefill(&prefill_ctx_, prefill, r_->cq.get());
    prefill_rpc_->Finish(&reply_, &status_, Issue(&prefilled_));
  }

  void Prefilled(bool) {
    client_ = nullptr;
    if (!status_.ok()) return End(status_);
    int first = reply_.first_token();
    Delta(&first, &first + 1);
    Timing(reply_.worker_id(), reply_.prefill_ms());
    if (tokens_ >= sampling_.max_tokens()) return Complete();
    pb::DecodeRequest decode;
    *decode.mutable_ticket() = held_.ticket();
    *decode.mutable_prompt_token_ids() = request_.token_ids();
    decode.set_first_token(first);
    OpenDecode(std::move(decode));
  }

  void OpenDecode(pb::DecodeRequest decode) {
    *decode.mutable_sampling() = sampling_;
    decode.set_stream_interval(r_->stream_interval);
    Client(&decode_ctx_);
    stream_ = decode_->AsyncDecode(&decode_ctx_, decode, r_->cq.get(), Issue(&opened_));
  }

  void Opened(bool ok) {
    if (ok) {
      stream_->Read(&update_, Issue(&read_));
    } else {
      stream_->Finish(&status_, Issue(&closed_));
    }
  }

  void ReadDone(bool ok) {
    if (!ok) {  // the worker ended the stream: its status says how
      stream_->Finish(&status_, Issue(&closed_));
      return;
    }
    if (update_.token_ids_size() > 0) {
      Delta(update_.token_ids().begin(), update_.token_ids().end());
      if (here_) Timing(held_.ticket().decode_worker(), update_.prefill_ms());
      here_ = false;
    }
    if (!update_.finish_reason().empty()) reason_ = update_.finish_reason();
    stream_->Read(&update_, Issue(&read_));  // to the stream's end (no cancellation)
  }

  void Closed(bool) {
    client_ = nullptr;
    if (!status_.ok() && reason_.empty()) return End(status_);
    Complete();
  }

  void Done(bool) {  // the RPC is over: finished, or cancelled by the client
    if (server_ctx_.IsCancelled() && client_ != nullptr) client_->TryCancel();
    cancelled_ = server_ctx_.IsCancelled();
  }

  void Wrote(bool ok) {
    writing_ = false;
    if (!ok) queue_.clear();  // the client is gone
    Flush();
  }

  void Finished(bool) {
    if (counted_) ++r_->free_streams;
    counted_ = false;
  }

  // ---- helpers ----
  void Client(grpc::ClientContext* ctx) {
    ctx->set_deadline(Deadline());
    client_ = ctx;
    if (cancelled_) ctx->TryCancel();
  }

  void Timing(const std::string& prefill_worker, double prefill_ms) {
    pb::GenerateResponse timing;
    timing.set_request_id(rid_);
    pb::Timing* t = timing.mutable_timing();
    t->set_prefill_worker(prefill_worker);
    t->set_decode_worker(held_.ticket().decode_worker());
    t->set_prefill_ms(prefill_ms);
    t->set_attempts(1);
    Send(std::move(timing));
  }

  template <typename It>
  void Delta(It begin, It end) {
    pb::GenerateResponse delta;
    delta.set_request_id(rid_);
    auto* ids = delta.mutable_delta()->mutable_token_ids();
    for (It it = begin; it != end; ++it) ids->Add(*it);
    tokens_ += ids->size();
    Send(std::move(delta));
  }

  void Complete() {
    pb::GenerateResponse finish;
    finish.set_request_id(rid_);
    pb::Finish* f = finish.mutable_finish();
    f->set_finish_reason(reason_.empty() ? "length" : reason_);
    f->set_prompt_tokens(request_.token_ids_size());
    f->set_completion_tokens(tokens_);
    Send(std::move(finish));
    End(grpc::Status::OK);
  }

  void Send(pb::GenerateResponse message) {
    queue_.push_back(std::move(message));
    Flush();
  }

  void End(const grpc::Status& status) {
    if (!status.ok()) queue_.clear();
    end_ = status;
    ending_ = true;
    Flush();
  }

  // One write in flight; the last message goes with the status (WriteAndFinish).
  void Flush() {
    if (writing_ || finishing_) return;
    if (ending_ && queue_.size() <= 1) {
      finishing_ = true;
      if (queue_.empty()) {
        writer_.Finish(end_, Issue(&finished_));
      } else {
        writer_.WriteAndFinish(queue_.front(), grpc::WriteOptions(), end_, Issue(&finished_));
        queue_.clear();
      }
      return;
    }
    if (queue_.empty()) return;
    current_ = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    writer_.Write(current_, Issue(&wrote_));
  }

  Router* r_;
  grpc::ServerContext server_ctx_;
  pb::GenerateRequest request_;
  grpc::ServerAsyncWriter<pb::GenerateResponse> writer_;
  Tag accepted_{this, &Call::Accepted}, reserved_{this, &Call::Reserved},
      prefilled_{this, &Call::Prefilled}, opened_{this, &Call::Opened},
      read_{this, &Call::ReadDone}, closed_{this, &Call::Closed}, done_{this, &Call::Done},
      wrote_{this, &Call::Wrote}, finished_{this, &Call::Finished};
  int pending_ = 0;
  bool counted_ = false, cancelled_ = false, here_ = false;
  pb::Prefill::Stub* prefill_ = nullptr;
  pb::Decode::Stub* decode_ = nullptr;
  std::string rid_;
  pb::SamplingParams sampling_;
  grpc::ClientContext reserve_ctx_, prefill_ctx_, decode_ctx_;
  grpc::ClientContext* client_ = nullptr;  // the client call in flight
  grpc::Status status_;
  std::unique_ptr<grpc::ClientAsyncResponseReader<pb::ReserveResponse>> reserve_;
  pb::ReserveResponse held_;
  std::unique_ptr<grpc::ClientAsyncResponseReader<pb::PrefillResponse>> prefill_rpc_;
  pb::PrefillResponse reply_;
  std::unique_ptr<grpc::ClientAsyncReader<pb::DecodeResponse>> stream_;
  pb::DecodeResponse update_;
  std::deque<pb::GenerateResponse> queue_;
  pb::GenerateResponse current_;
  bool writing_ = false, ending_ = false, finishing_ = false;
  grpc::Status end_;
  std::string reason_;
  int tokens_ = 0;
};

void Tag::Fire(bool ok) { Call::Run(this, ok); }

// One health check: SERVING, whatever the service named (the bench asks for "").
class HealthCall final : public Event {
 public:
  explicit HealthCall(Router* r) : r_(r), responder_(&ctx_) {
    r_->health.RequestCheck(&ctx_, &request_, &responder_, r_->cq.get(), r_->cq.get(), this);
  }

  void Fire(bool ok) override {
    if (answered_ || !ok) {
      delete this;
      return;
    }
    new HealthCall(r_);
    answered_ = true;
    grpc::health::v1::HealthCheckResponse reply;
    reply.set_status(grpc::health::v1::HealthCheckResponse::SERVING);
    responder_.Finish(reply, grpc::Status::OK, this);
  }

 private:
  Router* r_;
  grpc::ServerContext ctx_;
  grpc::health::v1::HealthCheckRequest request_;
  grpc::ServerAsyncResponseWriter<grpc::health::v1::HealthCheckResponse> responder_;
  bool answered_ = false;
};

void Usage(const std::string& why) {
  std::fprintf(stderr,
               "router_floor: %s\nusage: router_floor --port P --prefill A,B --decode C,D "
               "[--max-streams 256] [--stream-interval 1] [--remote-prefill-min-tokens 0]\n",
               why.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::string port, prefill, decode;
  Router r;
  r.free_streams = 256;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) Usage("no value after " + flag);
    std::string value = argv[++i];
    if (flag == "--port") port = value;
    else if (flag == "--prefill") prefill = value;
    else if (flag == "--decode") decode = value;
    else if (flag == "--max-streams") r.free_streams = std::atoi(value.c_str());
    else if (flag == "--stream-interval") r.stream_interval = std::atoi(value.c_str());
    else if (flag == "--remote-prefill-min-tokens") r.here_below = std::atoi(value.c_str());
    else Usage("unknown flag " + flag);
  }
  if (port.empty() || prefill.empty() || decode.empty()) Usage("--port, --prefill, --decode");
  // Distributions that build abseil without NDEBUG (Debian's) check every gRPC mutex for
  // lock-order cycles: ~9% of this router's CPU. A release build does not.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  for (const auto& a : Split(prefill)) {
    r.prefill.push_back(pb::Prefill::NewStub(
        grpc::CreateChannel(a, grpc::InsecureChannelCredentials())));
  }
  for (const auto& a : Split(decode)) {
    r.decode.push_back(pb::Decode::NewStub(
        grpc::CreateChannel(a, grpc::InsecureChannelCredentials())));
  }
  grpc::ServerBuilder builder;  // no default health service: its callback threads would poll
  builder.AddListeningPort("127.0.0.1:" + port, grpc::InsecureServerCredentials());
  builder.RegisterService(&r.service);
  builder.RegisterService(&r.health);
  r.cq = builder.AddCompletionQueue();
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) Usage("cannot listen on 127.0.0.1:" + port);
  new Call(&r);
  new HealthCall(&r);
  void* tag;
  bool ok;
  while (r.cq->Next(&tag, &ok)) static_cast<Event*>(tag)->Fire(ok);  // until stopped
  return 0;
}
