"""`pdserve generate`: send one prompt (or a chat: `--chat`, `--system`, `--message`) to a
router, stream the text, print the TTFT breakdown."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

import grpc
from google.protobuf.json_format import MessageToDict
from pdserve.common.sampling import SamplingParams
from pdserve.common.security import AUTH_HEADER, ChannelSecurity, open_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


def chat_messages(args: argparse.Namespace) -> list[router_pb2.ChatMessage]:
    """--system, --message ROLE TEXT..., then the prompt as the last user turn (with --chat,
    or when any of the others is given); [] for a plain prompt."""
    turns = [("system", args.system)] if args.system else []
    turns += [(role, text) for role, text in args.message or []]
    if not (args.chat or turns):
        return []
    if args.prompt:
        turns.append(("user", args.prompt))
    return [router_pb2.ChatMessage(role=role, content=text) for role, text in turns]


def build_request(args: argparse.Namespace) -> router_pb2.GenerateRequest:
    messages = chat_messages(args)
    req = router_pb2.GenerateRequest(prompt="" if messages else args.prompt, messages=messages,
                                     stop=args.stop or [], ignore_eos=args.ignore_eos,
                                     request_id=args.request_id or "")
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(req, name, value)
    return req


def stream(address: str, request: router_pb2.GenerateRequest, timeout_s: float,
           security: ChannelSecurity | None = None, api_key: str = ""
           ) -> Iterator[router_pb2.GenerateResponse]:
    metadata = [(AUTH_HEADER, f"Bearer {api_key}")] if api_key else None
    with open_channel(address, security) as channel:
        yield from router_pb2_grpc.RouterStub(channel).Generate(request, timeout=timeout_s,
                                                                metadata=metadata)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """--tls, --tls-ca, --tls-cert, --tls-key, --tls-server-name, --api-key (env twins)."""
    env = os.environ.get
    parser.add_argument("--tls", action="store_true", default=bool(env("PDSERVE_CLIENT_TLS")),
                        help="call the router over TLS (implied by --tls-ca; "
                             "env PDSERVE_CLIENT_TLS)")
    parser.add_argument("--tls-ca", default=env("PDSERVE_CLIENT_TLS_CA", ""),
                        help="CA certificate to verify the router with (default: the system "
                             "roots; env PDSERVE_CLIENT_TLS_CA)")
    parser.add_argument("--tls-cert", default=env("PDSERVE_CLIENT_TLS_CERT", ""),
                        help="client certificate, if the router asks for one "
                             "(env PDSERVE_CLIENT_TLS_CERT)")
    parser.add_argument("--tls-key", default=env("PDSERVE_CLIENT_TLS_KEY", ""),
                        help="key of --tls-cert (env PDSERVE_CLIENT_TLS_KEY)")
    parser.add_argument("--tls-server-name", default=env("PDSERVE_CLIENT_TLS_SERVER_NAME", ""),
                        help="name expected in the server certificate (default: the host of "
                             "the address; env PDSERVE_CLIENT_TLS_SERVER_NAME)")
    parser.add_argument("--api-key", default=env("PDSERVE_API_KEY", ""),
                        help="API key sent as 'authorization: Bearer <key>' "
                             "(env PDSERVE_API_KEY; prefer the env var: flags show in ps)")


def security_from_args(args: argparse.Namespace) -> ChannelSecurity | None:
    if not (args.tls or args.tls_ca or args.tls_cert):
        return None
    return ChannelSecurity(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key,
                           server_name=args.tls_server_name)


def positive_seconds(text: str) -> float:
    """argparse type of --timeout: a number of seconds > 0."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds > 0")
    return seconds


def connect_hint(code: grpc.StatusCode, details: str, *, tls: bool) -> str:
    """What to check when the call never reached the router (UNAVAILABLE on connect): nothing
    listening at the address, or a TLS port called in plaintext (which the router closes:
    `Socket closed`). "" for every other failure."""
    if code != grpc.StatusCode.UNAVAILABLE or "failed to connect" not in details:
        return ""
    if "Connection refused" in details:
        return " (is a router running at --address?)"
    return "" if tls else " (is the router serving TLS? try --tls / --tls-ca)"


def breakdown(t: router_pb2.Timing) -> str:
    parts = t.queue_ms + t.prefill_ms + t.kv_transfer_ms + t.decode_start_ms
    return "\n".join([
        f"TTFT {t.ttft_ms:.1f} ms = queue {t.queue_ms:.1f} + prefill {t.prefill_ms:.1f} + "
        f"kv_transfer {t.kv_transfer_ms:.1f} + decode_start {t.decode_start_ms:.1f} "
        f"(+ {max(0.0, t.ttft_ms - parts):.1f} router/network)",
        f"{_handoff(t)}; prefill {t.prefill_worker or '-'}, decode {t.decode_worker or '-'}",
        f"prefix cache: {t.cached_tokens} prompt tokens reused (prefill held "
        f"{t.prefill_cached_tokens}, decode held {t.decode_cached_tokens})",
        *(_rank_line(r) for r in t.kv_ranks),
    ])


def _handoff(t: router_pb2.Timing) -> str:
    """How the prompt's KV reached the decode side."""
    if t.kv_transport == "local":
        return "no KV handoff: one co-located engine prefilled and decodes"
    if t.prefill_on == "decode":
        return "no KV handoff: the decode worker prefilled the uncached part itself"
    return (f"KV handoff: {t.kv_pages} of {t.prompt_pages or t.kv_pages} prompt pages, "
            f"{t.kv_bytes:,} bytes over {t.kv_transport or '-'} "
            f"(moving them took {t.kv_transfer_total_ms:.1f} ms)")


_RELAYOUT = {"": "as laid out", "receiver": "re-laid out in the receiver's copy",
             "staging": "packed through staging"}


def _rank_line(r: common_pb2.RankTransfer) -> str:
    """One decode rank's part of a handoff between tensor-parallel workers."""
    src = (f"prefill rank {r.prefill_rank_first}" if r.prefill_rank_first == r.prefill_rank_last
           else f"prefill ranks {r.prefill_rank_first}..{r.prefill_rank_last}")
    return (f"  decode rank {r.decode_rank} <- {src}: {r.kv_bytes:,} bytes over {r.transport}, "
            f"{_RELAYOUT.get(r.relayout, r.relayout)}, {r.handoff_ms:.1f} ms "
            f"(moving them took {r.total_ms:.1f} ms)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve generate", description=__doc__)
    parser.add_argument("prompt", nargs="?", default="",
                        help="the prompt text (with --chat: the user's message)")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a chat (a user message rendered with the "
                             "model's chat template) instead of plain text")
    parser.add_argument("--system", help="a system message before it (implies --chat)")
    parser.add_argument("--message", nargs=2, action="append", metavar=("ROLE", "TEXT"),
                        help="an earlier chat turn, in order (repeatable; implies --chat)")
    parser.add_argument(
        "--address",
        default=os.environ.get("PDSERVE_ROUTER_ADDRESS", "localhost:50051"),
        help="router host:port (env PDSERVE_ROUTER_ADDRESS; default localhost:50051)",
    )
    server = SamplingParams()  # what the router fills in for a field left unset
    parser.add_argument("--max-tokens", type=int,
                        help=f"most tokens to generate (server default {server.max_tokens}, "
                             "lowered to what the context leaves)")
    parser.add_argument("--temperature", type=float,
                        help=f"0 = greedy (server default {server.temperature})")
    parser.add_argument("--top-p", type=float,
                        help=f"nucleus sampling: keep the most likely tokens up to this "
                             f"probability, in (0, 1] (server default {server.top_p}: off)")
    parser.add_argument("--top-k", type=int,
                        help=f"keep the k most likely tokens (server default {server.top_k}: "
                             "off)")
    parser.add_argument("--seed", type=int,
                        help="seed of this request's sampling, for repeatable output "
                             "(server default: none, a fresh draw)")
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past the end-of-sequence token, up to "
                             "--max-tokens (default: stop at it)")
    parser.add_argument("--request-id",
                        help="the request's id in logs, traces and metrics (default: one the "
                             "router makes up)")
    parser.add_argument("--timeout", type=positive_seconds, default=300.0,
                        help="seconds the whole request may take, > 0 (default 300)")
    parser.add_argument(
        "--json", action="store_true", help="print every stream message as a JSON line"
    )
    add_security_flags(parser)
    args = parser.parse_args(argv)
    if not (args.prompt or args.message):
        parser.error("a prompt (or --message turns) is required")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    for flag in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            parser.error(f"--{flag.replace('_', '-')}={path!r}: no such file")
    out = sys.stdout
    timing: router_pb2.Timing | None = None
    try:
        for msg in stream(args.address, build_request(args), args.timeout,
                          security_from_args(args), args.api_key):
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
        details = exc.details() or ""
        print(f"\npdserve generate: {exc.code().name}: {details}"
              f"{connect_hint(exc.code(), details, tls=security_from_args(args) is not None)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
