"""Fail points: named places on the request path where a test can stop or kill a process.

Off unless `PDSERVE_FAILPOINTS` is set (read once, at import); then `hit(name, request_id)`
costs one dict lookup. The variable holds `;`-separated rules:

    POINT[@MATCH]=ACTION[:ARG]

- POINT: a name below; MATCH: the rule fires only for request ids containing it (the router's
  attempts and the workers see `<id>` and `<id>#<n>`), default any.
- ACTION: `pause:PATH` writes PATH.hit (its content: the request id) and waits until PATH.go
  exists (at most 10 minutes); `sleep:MS` waits MS milliseconds; `kill` is kill -9 of this
  very process (SIGKILL, nothing cleaned up: the point of a fault test); `exit:CODE` is
  `os._exit(CODE)`; `fail` raises `FailPointError` (the code around it reports it as an
  internal error).

Points, in the order a request meets them:

| point | process | where |
|---|---|---|
| `router.queued` | router | request validated, before its decode reservation |
| `router.reserved` | router | reservation held, before the Prefill call |
| `prefill.queued` | prefill | Prefill received, before the engine takes the prompt |
| `prefill.handoff` | prefill | first token sampled, before the agent ships the pages |
| `kv.send` | sending agent (or prefill, on its lane) | before the first byte goes out |
| `kv.receive` | receiving agent | write accepted, before the bytes land (TCP transport) |
| `decode.start` | decode | Decode received, before the pages are adopted |
| `decode.token` | decode | before each message after the first (the sequence is live) |
| `router.decoding` | router | before relaying each decode message to the client |
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "PDSERVE_FAILPOINTS"
PAUSE_LIMIT_S = 600.0
POINTS = frozenset({"router.queued", "router.reserved", "prefill.queued", "prefill.handoff",
                    "kv.send", "kv.receive", "decode.start", "decode.token",
                    "router.decoding"})
ACTIONS = frozenset({"pause", "sleep", "kill", "exit", "fail"})


class FailPointError(Exception):
    """Raised by a `fail` rule."""


@dataclass(frozen=True)
class Rule:
    point: str
    match: str
    action: str
    arg: str


def parse(text: str) -> dict[str, list[Rule]]:
    """The rules of a PDSERVE_FAILPOINTS value by point; ValueError naming a bad rule."""
    rules: dict[str, list[Rule]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        target, sep, action = part.partition("=")
        point, _, match = target.partition("@")
        action, _, arg = action.partition(":")
        if not sep or point not in POINTS or action not in ACTIONS:
            raise ValueError(f"{ENV}: bad rule {part!r} (POINT[@MATCH]=ACTION[:ARG], points "
                             f"{', '.join(sorted(POINTS))}; actions {', '.join(sorted(ACTIONS))})")
        if action in ("pause", "sleep", "exit") and not arg:
            raise ValueError(f"{ENV}: rule {part!r}: {action} needs an argument")
        rules.setdefault(point, []).append(Rule(point, match, action, arg))
    return rules


_RULES = parse(os.environ.get(ENV, ""))


def active() -> bool:
    """Whether any failpoint is set in this process."""
    return bool(_RULES)


def hit(point: str, request_id: str = "") -> None:
    """Run the rules of `point` for this request (nothing at all when none are set)."""
    if not _RULES:
        return
    for rule in _RULES.get(point, ()):
        if rule.match in request_id:
            _run(rule, request_id)


def _run(rule: Rule, request_id: str) -> None:
    if rule.action == "pause":
        path = Path(rule.arg)
        path.with_name(path.name + ".hit").write_text(request_id)
        go = path.with_name(path.name + ".go")
        deadline = time.monotonic() + PAUSE_LIMIT_S
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # a test's fail point: polled, bounded
    elif rule.action == "sleep":
        time.sleep(float(rule.arg) / 1e3)
    elif rule.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif rule.action == "exit":
        os._exit(int(rule.arg))
    else:
        raise FailPointError(f"fail point {rule.point} for {request_id}")
