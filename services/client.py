"""`pdserve generate`: send one prompt to a router, stream the text, print the TTFT breakdown."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

import grpc
from google.protobuf.json_format import MessageToDict
from pdserve.v1 import router_pb2, router_pb2_grpc


def build_request(args: argparse.Namespace) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(prompt=args.prompt, stop=args.stop or [],
                                     ignore_eos=args.ignore_eos, request_id=args.request_id or "")
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(req, name, value)
    return req


def stream(address: str, request: router_pb2.GenerateRequest, timeout_s: float
           ) -> Iterator[router_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        yield from router_pb2_grpc.RouterStub(channel).Generate(request, timeout=timeout_s)


def breakdown(t: router_pb2.Timing) -> str:
    parts = t.queue_ms + t.prefill_ms + t.kv_transfer_ms + t.decode_start_ms
    return "\n".join([
        f"TTFT {t.ttft_ms:.1f} ms = queue {t.queue_ms:.1f} + prefill {t.prefill_ms:.1f} + "
        f"kv_transfer {t.kv_transfer_ms:.1f} + decode_start {t.decode_start_ms:.1f} "
        f"(+ {max(0.0, t.ttft_ms - parts):.1f} router/network)",
        f"KV handoff: {t.kv_pages} pages, {t.kv_bytes:,} bytes over {t.kv_transport or '-'}; "
        f"prefill {t.prefill_worker or '-'}, decode {t.decode_worker or '-'}",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve generate", description=__doc__)
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument(
        "--address",
        default=os.environ.get("PDSERVE_ROUTER_ADDRESS", "localhost:50051"),
        help="router host:port (env PDSERVE_ROUTER_ADDRESS; default localhost:50051)",
    )
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--temperature", type=float, help="0 = greedy (server default 1.0)")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--request-id")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    parser.add_argument(
        "--json", action="store_true", help="print every stream message as a JSON line"
    )
    args = parser.parse_args(argv)
    out = sys.stdout
    timing: router_pb2.Timing | None = None
    try:
        for msg in stream(args.address, build_request(args), args.timeout):
            if args.json:
                print(json.dumps(MessageToDict(msg)), flush=True)
                continue
            kind = msg.WhichOneof("kind")
            if kind == "delta":
                out.write(msg.delta.text)
                out.flush()
            elif kind == "timing":
                timing = msg.timing
            elif kind == "finish":
                f = msg.finish
                print(f"\n\n{breakdown(timing)}" if timing is not None else "")
                print(
                    f"finish: {f.finish_reason}; {f.prompt_tokens} prompt + {f.completion_tokens} "
                    f"completion tokens; e2e {f.e2e_ms:.1f} ms; TPOT {f.tpot_ms:.1f} ms; "
                    f"ITL mean {f.itl_mean_ms:.1f} / max {f.itl_max_ms:.1f} ms"
                )
    except grpc.RpcError as exc:
        print(f"\npdserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
