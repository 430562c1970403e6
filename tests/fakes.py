"""Shared test doubles and helpers: a tiny tokenizer-only model directory, scripted
Prefill/Decode servers that speak only the pdserve.v1 contract (for router tests), and a fake
clock."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from pdserve.common import errors
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
)
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

CORPUS = ["hello world, the quick brown fox jumps over the lazy dog",
          "naïve café, Straße, 中文文本, 日本語, emoji 🙂🚀", "STOP here ### and END."]
TEXT = "hello world, the quick brown fox jumps over the lazy dog"


class FakeClock:
    """A monotonic clock a test moves by hand (`clock.now += 1.0`)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_model_dir(root: Path, *, max_context: int = 64, merges: bool = True) -> Path:
    """A tiny Hugging Face-style directory: byte-level BPE tokenizer.json plus configs.

    `merges=False` gives a bytes-only vocabulary: every UTF-8 byte is its own token, so every
    non-ASCII character is split across tokens.
    """
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320 if merges else 258, show_progress=False,
                                  special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "config.json").write_text(json.dumps({
        "vocab_size": tok.get_vocab_size(), "max_position_embeddings": max_context,
        "bos_token_id": 0, "eos_token_id": 1}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>"}))
    return root


@dataclass
class Script:
    """What the fake workers do; what they saw."""

    tokens: list[int] = field(default_factory=list)  # first token, then what decode streams
    decode_finish: str = "length"
    prefill_failures: list[grpc.StatusCode] = field(default_factory=list)
    decode_fail_after: int | None = None
    decode_start_failures: list[grpc.StatusCode] = field(default_factory=list)
    exhausted: bool = False
    block_prefill: threading.Event | None = None
    block_decode_after: int | None = None
    reserves: list[str] = field(default_factory=list)
    prefills: list[str] = field(default_factory=list)
    decodes: list[decode_pb2.DecodeRequest] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)
    aborted_tickets: set[tuple[str, int]] = field(default_factory=set)
    cancelled: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, script: Script, name: str):
        self.script, self.name = script, name

    def Prefill(self, request, context):
        with self.script.lock:
            self.script.prefills.append(self.name)
            failure = self.script.prefill_failures.pop(0) if self.script.prefill_failures else None
        if failure is not None:
            context.abort(failure, f"{self.name} failed on purpose")
        if self.script.block_prefill is not None:
            while context.is_active() and not self.script.block_prefill.wait(0.02):
                pass
            if not context.is_active():
                self.script.cancelled.set()
                return prefill_pb2.PrefillResponse()
        report = common_pb2.TransferReport(handoff_ms=2.5, kv_bytes=4096,
                                           kv_pages=len(request.destination.page_ids),
                                           transport="local")
        return prefill_pb2.PrefillResponse(first_token=self.script.tokens[0], queue_ms=1.0,
                                           prefill_ms=3.0, transfer=report, worker_id=self.name)

    def Stats(self, request, context):
        return common_pb2.WorkerStats(worker_id=self.name, role="prefill")


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, script: Script, name: str):
        self.script, self.name = script, name

    def Reserve(self, request, context):
        self.script.reserves.append(self.name)
        if self.script.exhausted:
            raise errors.ResourceExhausted(f"{self.name} has no free pages")
        ticket = common_pb2.Ticket(request_id=request.request_id, epoch=len(self.script.reserves),
                                   decode_worker=self.name)
        pages = list(range(-(-request.num_prompt_tokens // 16)))
        return decode_pb2.ReserveResponse(ticket=ticket, destination=common_pb2.KVDestination(
            agent_address="agent:1", pool_id="pool", page_ids=pages))

    def Decode(self, request, context):
        self.script.decodes.append(request)
        with self.script.lock:
            failure = (self.script.decode_start_failures.pop(0)
                       if self.script.decode_start_failures else None)
        if failure is not None:
            context.abort(failure, f"{self.name} could not start the sequence")
        yield decode_pb2.DecodeResponse(decode_start_ms=1.5)
        rest = self.script.tokens[1:]
        for i, token in enumerate(rest):
            if self.script.decode_fail_after == i:
                raise errors.Unavailable(f"{self.name} died")
            if self.script.block_decode_after == i:
                while context.is_active():
                    time.sleep(0.02)
                self.script.cancelled.set()
                return
            if (request.ticket.request_id, request.ticket.epoch) in self.script.aborted_tickets:
                return
            last = i == len(rest) - 1
            yield decode_pb2.DecodeResponse(token_ids=[token],
                                            finish_reason=self.script.decode_finish if last else "")
            time.sleep(0.005)

    def Abort(self, request, context):
        self.script.aborts.append((request.ticket.request_id, request.reason))
        self.script.aborted_tickets.add((request.ticket.request_id, request.ticket.epoch))
        return decode_pb2.AbortResponse(found=True)

    def Stats(self, request, context):
        return common_pb2.WorkerStats(worker_id=self.name, role="decode", num_pages=100,
                                      free_pages=100)


def run(stub, **kwargs) -> list[router_pb2.GenerateResponse]:
    return list(stub.Generate(router_pb2.GenerateRequest(**kwargs), timeout=20))


def kinds(responses) -> str:
    return "".join({"delta": "d", "timing": "t", "finish": "f"}[r.WhichOneof("kind")]
                   for r in responses)


def text_of(responses) -> str:
    return "".join(r.delta.text for r in responses if r.HasField("delta"))
