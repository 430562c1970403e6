"""The fault matrix's bookkeeping: requests parked at a phase by fail points, the checks every
ended stream must pass, and the table (fault x phase -> outcome) the run writes.

Phases, and the fail point that parks a request there (its id contains the phase's tag):

| phase | fail point | state |
|---|---|---|
| queued | prefill `prefill.queued` | decode pages reserved; prompt not in prefill's engine |
| prefilling | prefill `prefill.handoff` | prefill computed, pages held on both sides, none sent |
| handing off | receiving agent `kv.receive` | the write accepted, the bytes on their way |
| decoding | decode `decode.token` | the sequence live, its first token at the client |
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from tests.faults.stack import FaultStack, Stream
from tests.support import wait_for

PHASES = {"queued": ("prefill", "prefill.queued"), "prefilling": ("prefill", "prefill.handoff"),
          "handing off": ("agent-b", "kv.receive"), "decoding": ("decode", "decode.token")}
TAGS = {phase: "v-" + phase.replace(" ", "-") for phase in PHASES}
NAMED = re.compile(r"(decode|prefill|agent|router|kvtransfer)\b.*\d+\.\d+\.\d+\.\d+:\d+|"
                   r"no healthy (decode|prefill) worker|failed before its first token")

ROWS: list[tuple[str, str, str]] = []  # (fault, phase, outcome), in the order they ran


def failpoint_rules(pause_dir: Path) -> dict[str, str]:
    """Per process (name prefix), the rules that park each phase's requests."""
    rules: dict[str, list[str]] = {}
    for phase, (node, point) in PHASES.items():
        rules.setdefault(node, []).append(f"{point}@{TAGS[phase]}=pause:{pause_dir / TAGS[phase]}")
    return {node: ";".join(r) for node, r in rules.items()}


def node_rules(fs: FaultStack, pause_dir: Path) -> dict[str, str]:
    rules = failpoint_rules(pause_dir)
    return {name: rules[prefix] for name in fs.nodes for prefix in rules
            if name.startswith(prefix)}


@dataclass
class Parked:
    phase: str
    stream: Stream
    expected: list[int]


def park(fs: FaultStack, pause_dir: Path, prompt: str, expected: list[int], round_tag: str,
         max_tokens: int) -> list[Parked]:
    """Start one request per phase and wait until each is held at its phase."""
    for path in pause_dir.glob("*"):
        path.unlink()
    parked = [Parked(phase, fs.stream(prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                      request_id=f"{round_tag}-{TAGS[phase]}"), expected)
              for phase in PHASES]
    hits = [pause_dir / f"{TAGS[phase]}.hit" for phase in PHASES]
    assert wait_for(lambda: all(h.exists() for h in hits) or any(p.stream.done()
                                                                 for p in parked), 90), \
        f"requests did not reach their phases:\n{fs.logs()}"
    ended = [(p.phase, p.stream.code, p.stream.details) for p in parked if p.stream.done()]
    assert not ended, f"a request ended before its phase: {ended}\n{fs.logs()}"
    return parked


def release(pause_dir: Path) -> None:
    for tag in TAGS.values():
        (pause_dir / f"{tag}.go").touch()


def check_stream(stream: Stream, expected: list[int], killed: str) -> str:
    """The checks every ended stream passes; returns its outcome for the table."""
    assert stream.tokens == expected[:len(stream.tokens)], \
        f"repeated or reordered tokens: {stream.tokens} vs {expected}"
    if stream.code == "OK":
        assert stream.tokens == expected, f"finished with {stream.tokens}, not {expected}"
        return "OK, exact"
    assert stream.code not in ("UNKNOWN", "INTERNAL", ""), (stream.code, stream.details)
    assert stream.details.strip(), f"{stream.code} without a message"
    if killed != "router":  # a dead router cannot explain itself; gRPC says the socket closed
        assert NAMED.search(stream.details), f"the message names no peer: {stream.details}"
    return f"{stream.code} after {len(stream.tokens)} tok: {_short(stream.details)}"


def _short(details: str, limit: int = 90) -> str:
    text = re.sub(r"\d+\.\d+\.\d+\.\d+:\d+", "ADDR", details.splitlines()[0])
    text = re.sub(r"#?\d{6,}|[0-9a-f]{8,}", "N", text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def write_table(path: Path | None = None) -> str:
    """The matrix as Markdown; written to `path` (default build/fault-matrix.md)."""
    lines = ["| fault | phase | outcome |", "|---|---|---|"]
    lines += [f"| {fault} | {phase} | {outcome.replace('|', '/')} |"
              for fault, phase, outcome in ROWS]
    text = "\n".join(lines) + "\n"
    target = path or Path(os.environ.get("PDSERVE_FAULT_TABLE", "build/fault-matrix.md"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return text
