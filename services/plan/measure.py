"""`pdserve profile`: measure the engine on this machine and write a profile for `pdserve plan`.

Runs the real engine in this process on a model, as a worker would (same engine, same
threads), and times its steps:

- prefill: one step of k prompts of L tokens each, nothing decoding, for every L of
  --prompt-lengths and k of --prefill-batches (k x L within one step's budget);
- decode: steps of b sequences with C tokens of context each, for every b of --decode-batches
  and C of --contexts;
- handoff: a memory copy of KV bytes (the same-host path is one copy), for its GB/s; its base
  (the RPC round trips around it) is --handoff-base-ms, as `pdserve bench handoff` reports it;
- waking: a step of the shortest prompt after the engine sat idle for each of --idle-gaps ms,
  against the same step right after another: what a worker's first step after a quiet spell
  costs beyond its model (cold caches, a sleeping core), fitted as `SimProfile.wake_ms`.

Each point is the median of --repeats steps. The step-time models of `pdserve.sim.profile` are
fitted to them by least squares (no negative cost) and written as a profile JSON that
`pdserve plan --profile` and `pdserve sim --profile` read; the measured points, the fit and
its error per point are printed (and written with --points-json). With --check WORKLOAD, a
workload is then replayed through the engine and through the simulator on the new profile,
and their TTFT and TPOT p50 printed side by side (`pdserve.plan.replay`).

    pdserve profile --model bench-7m --out bench-7m.profile.json --check fixed:256,64
    pdserve plan --profile bench-7m.profile.json --workload chat
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.common.config import option, parse_config, require
from pdserve.common.models import DEFAULT_MODEL, builtin_models_help
from pdserve.plan.fit import Fit, fit_nonnegative, fit_wake
from pdserve.plan.replay import Check, check
from pdserve.plan.workload import Workload
from pdserve.sim.profile import SimProfile
from pdserve.worker.config import DTYPES

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine


@dataclass(frozen=True)
class ProfileConfig:
    """Options of `pdserve profile` (each also PDSERVE_PROFILE_<NAME>)."""

    model: str = option(DEFAULT_MODEL, "a local Hugging Face model directory, or a built-in "
                                       f"model: {builtin_models_help()}")
    dtype: str = option("auto", "weights and KV dtype, as the workers' --dtype", choices=DTYPES)
    device: str = option("cpu", "cpu, cuda or cuda:N")
    threads: int = option(0, "torch threads (0: this process's CPU allowance, as a worker)")
    block_size: int = option(16, "tokens per KV page")
    prompt_lengths: tuple[str, ...] = option(("32", "128", "512", "1024"),
                                             "prompt lengths timed (clipped to the context)")
    prefill_batches: tuple[str, ...] = option(("1", "2"), "prompts per prefill step")
    decode_batches: tuple[str, ...] = option(("1", "4", "16"), "sequences per decode step")
    contexts: tuple[str, ...] = option(("64", "512"), "context tokens of each decoding "
                                                      "sequence")
    repeats: int = option(5, "steps timed per point (their median counts)")
    idle_gaps: tuple[str, ...] = option(("2", "10", "50", "200"),
                                        "idle spells (ms) before the steps that time waking")
    handoff_base_ms: float = option(0.5, "fixed cost of one KV handoff (RPCs), ms")
    check: str = option("", "then replay this workload (pdserve bench serve's --workload "
                            "syntax) through the engine, co-located with the workers' default "
                            "chunking, and through the simulator on the new profile, and "
                            "print both TTFT and TPOT p50 (empty: no check)")
    check_rate: float = option(4.0, "--check: Poisson arrivals at this rate (req/s)")
    check_requests: int = option(60, "--check: requests replayed")
    out: str = option("profile.json", "where the profile is written")
    points_json: str = option("", "also write the measured points and the fit here")

    def __post_init__(self) -> None:
        for name in ("prompt_lengths", "prefill_batches", "decode_batches", "contexts",
                     "idle_gaps"):
            values = getattr(self, name)
            require(bool(values) and all(v.isdigit() and int(v) > 0 for v in values), name,
                    values, "positive integers, comma-separated")
        require(self.repeats > 0, "repeats", self.repeats, "> 0")
        require(self.check_rate > 0, "check_rate", self.check_rate, "> 0")
        require(self.check_requests > 0, "check_requests", self.check_requests, "> 0")
        require(self.threads >= 0, "threads", self.threads, ">= 0")
        require(self.block_size > 0, "block_size", self.block_size, "> 0")
        require(self.handoff_base_ms >= 0, "handoff_base_ms", self.handoff_base_ms, ">= 0")


WARM_MS = 50.0  # busy time before each idle spell timed


def _ints(values: tuple[str, ...]) -> list[int]:
    return sorted({int(v) for v in values})


class Timer:
    """Drives an engine through the steps to time (the engine is this object's alone)."""

    def __init__(self, engine: Engine, repeats: int):
        from pdserve.common.sampling import SamplingParams

        self.engine = engine
        self.repeats = repeats
        self._count = 0
        self._vocab = engine.model.vocab_size
        self._params = SamplingParams
        self._rng = random.Random(0)

    def _add(self, length: int, max_tokens: int) -> str:
        self._count += 1
        seq_id = f"p{self._count}"
        prompt = [self._rng.randrange(3, self._vocab) for _ in range(length)]
        self.engine.add_request(seq_id, prompt, self._params(max_tokens=max_tokens,
                                                             temperature=0.0, ignore_eos=True))
        return seq_id

    def _prefill_step_ms(self, length: int, batch: int) -> float:
        for _ in range(batch):
            self._add(length, 1)
        start = time.perf_counter()
        self.engine.step()
        ms = (time.perf_counter() - start) * 1e3
        assert not self.engine.has_work(), "a prefill point took more than one step"
        return ms

    def prefill_ms(self, length: int, batch: int) -> float:
        """Median ms of one step computing `batch` whole prompts of `length`, alone."""
        return statistics.median(self._prefill_step_ms(length, batch)
                                 for _ in range(self.repeats))

    def after_idle_ms(self, length: int, gaps_ms: list[int]) -> tuple[float, dict[int, float]]:
        """Median ms of a step of one prompt of `length` right after another (back to back),
        and after the engine sat idle for each of `gaps_ms`, `repeats` times. Before each
        idle spell the engine steps for `WARM_MS` (and at least 3 steps): how fast a step is
        depends on how long the engine has been busy, not only on the last spell (a 2 ms spell
        two steps after a 200 ms one gave steps twice as long as back to back)."""
        warm: list[float] = []
        after: dict[int, list[float]] = {gap: [] for gap in gaps_ms}
        for _ in range(self.repeats):
            for gap in gaps_ms:
                busy, steps = 0.0, 0
                while busy < WARM_MS or steps < 3:
                    ms = self._prefill_step_ms(length, 1)
                    busy, steps = busy + ms, steps + 1
                warm.append(ms)
                time.sleep(gap / 1e3)
                after[gap].append(self._prefill_step_ms(length, 1))
        return statistics.median(warm), {g: statistics.median(t) for g, t in after.items()}

    def decode_ms(self, batch: int, context: int) -> list[tuple[int, float]]:
        """(context tokens in all, ms) of `repeats` decode steps of `batch` sequences whose
        prompts are `context` tokens."""
        ids = [self._add(context, self.repeats + 2) for _ in range(batch)]
        while self.engine.waiting:
            self.engine.step()
        out = []
        for _ in range(self.repeats):
            total = sum(s.num_tokens for s in self.engine.running)
            start = time.perf_counter()
            self.engine.step()
            out.append((total, (time.perf_counter() - start) * 1e3))
        for seq_id in ids:
            self.engine.abort(seq_id)
        return out


def copy_gb_s(page_bytes: int, device: str) -> float:
    """GB/s of one memory copy of 64 pages' bytes (median of 5)."""
    import torch

    src = torch.ones(64 * page_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return src.numel() / statistics.median(times) / 1e9


@dataclass(frozen=True)
class Measured:
    prefill: list[dict[str, float]]  # length, batch, tokens, attended, ms
    decode: list[dict[str, float]]   # batch, context_tokens, ms
    prefill_fit: Fit
    decode_fit: Fit
    # gap_ms, ms, back_to_back_ms, excess_ms
    idle: list[dict[str, float]] = dataclasses.field(default_factory=list)
    idle_fit: Fit | None = None  # [idle_wake_ms, idle_wake_half_ms]; None: no idle points


def fit_points(prefill: list[dict[str, float]], decode: list[dict[str, float]],
               idle: list[dict[str, float]] | None = None) -> Measured:
    """The profile's step models fitted to the measured points."""
    prefill_fit = fit_nonnegative([[1.0, p["tokens"], p["attended"]] for p in prefill],
                                  [p["ms"] for p in prefill])
    decode_fit = fit_nonnegative([[1.0, d["batch"], d["context_tokens"]] for d in decode],
                                 [d["ms"] for d in decode])
    idle_fit = fit_wake([i["gap_ms"] for i in idle], [i["excess_ms"] for i in idle]) \
        if idle else None
    return Measured(prefill, decode, prefill_fit, decode_fit, idle or [], idle_fit)


def measure(cfg: ProfileConfig, progress: bool = True) -> tuple[SimProfile, Measured]:
    import torch
    from pdserve.common.cpus import cpu_allowance
    from pdserve.engine.setup import build_engine, pool_plan

    threads = cfg.threads or cpu_allowance()
    torch.set_num_threads(threads)
    lengths, batches = _ints(cfg.prompt_lengths), _ints(cfg.prefill_batches)
    decode_batches, contexts = _ints(cfg.decode_batches), _ints(cfg.contexts)
    longest = max(max(lengths), max(contexts)) + cfg.repeats + 4
    budget = max(max(lengths) * max(batches), max(decode_batches) + 1)
    pages = max(max(decode_batches) * (-(-longest // cfg.block_size)),
                max(batches) * (-(-max(lengths) // cfg.block_size))) + 8
    # the pool a worker would have (512 MiB, or one full-context sequence)
    engine, _ = build_engine(cfg.model, role="colocated", dtype=cfg.dtype, device=cfg.device,
                             block_size=cfg.block_size, chunk_size=budget,
                             max_prefill_tokens=budget,
                             max_num_seqs=max(decode_batches) + max(batches),
                             prefix_caching=False)
    try:
        if engine.config.num_pages < pages:
            raise ValueError(f"the points need {pages} KV pages, the pool holds "
                             f"{engine.config.num_pages}: fewer --decode-batches or --contexts")
        limit = engine.max_model_len - cfg.repeats - 3
        lengths = sorted({min(n, limit) for n in lengths})
        contexts = sorted({min(n, limit) for n in contexts})
        timer = Timer(engine, cfg.repeats)
        timer.prefill_ms(min(lengths), 1)  # warm-up
        timer.decode_ms(1, min(contexts))
        prefill = []
        for length in lengths:
            for batch in batches:
                ms = timer.prefill_ms(length, batch)
                prefill.append({"length": length, "batch": batch, "tokens": length * batch,
                                "attended": batch * length * (length + 1) / 2, "ms": ms})
                if progress:
                    print(f"prefill {batch} x {length} tokens: {ms:.2f} ms", file=sys.stderr)
        decode = []
        for batch in decode_batches:
            for context in contexts:
                steps = timer.decode_ms(batch, context)
                total = statistics.median(t for t, _ in steps)
                ms = statistics.median(m for _, m in steps)
                decode.append({"batch": batch, "context_tokens": total, "ms": ms})
                if progress:
                    print(f"decode {batch} x {context} context: {ms:.2f} ms", file=sys.stderr)
        warm, after = timer.after_idle_ms(min(lengths), _ints(cfg.idle_gaps))
        idle = [{"gap_ms": gap, "ms": ms, "back_to_back_ms": warm, "excess_ms": ms - warm}
                for gap, ms in after.items()]
        if progress:
            print(f"1 x {min(lengths)} tokens after idle " + ", ".join(
                f"{gap} ms: {ms:.2f}" for gap, ms in after.items())
                  + f" (back to back {warm:.2f}) ms", file=sys.stderr)
        fingerprint = engine.model.fingerprint(cfg.block_size)
        worker_pool = pool_plan(engine.model, "decode", cfg.block_size)
        gb_s = copy_gb_s(fingerprint.page_bytes, cfg.device)
    finally:
        engine.close()
    measured = fit_points(prefill, decode, idle)
    p, d = measured.prefill_fit.coefficients, measured.decode_fit.coefficients
    wake, half = measured.idle_fit.coefficients if measured.idle_fit else (0.0, 10.0)
    profile = SimProfile(
        prefill_base_ms=p[0], prefill_ms_per_token=p[1], prefill_ms_per_attended_token=p[2],
        decode_base_ms=d[0], decode_ms_per_seq=d[1], decode_ms_per_attended_token=d[2],
        handoff_base_ms=cfg.handoff_base_ms, handoff_gb_s=gb_s,
        kv_bytes_per_token=fingerprint.page_bytes // cfg.block_size,
        block_size=cfg.block_size, num_pages=worker_pool.num_pages,
        max_model_len=worker_pool.max_model_len, idle_wake_ms=wake, idle_wake_half_ms=half,
        devices_per_worker=1.0 if cfg.device.startswith("cuda") else float(threads))
    return profile, measured


def report(measured: Measured) -> str:
    lines = ["prefill step             measured ms  fitted ms  error"]
    for point, fitted, err in zip(measured.prefill, measured.prefill_fit.predicted,
                                  measured.prefill_fit.relative_errors):
        what = f"{point['batch']:.0f} x {point['length']:.0f} tokens"
        lines.append(f"  {what:<22} {point['ms']:>11.2f} {fitted:>10.2f} {err:>6.0%}")
    lines.append("decode step              measured ms  fitted ms  error")
    for point, fitted, err in zip(measured.decode, measured.decode_fit.predicted,
                                  measured.decode_fit.relative_errors):
        what = f"{point['batch']:.0f} seqs, {point['context_tokens']:.0f} ctx"
        lines.append(f"  {what:<22} {point['ms']:>11.2f} {fitted:>10.2f} {err:>6.0%}")
    if measured.idle_fit is not None:
        wake, half = measured.idle_fit.coefficients
        lines.append(f"after idle               measured ms  excess ms  fitted  (wake "
                     f"{wake:.2f} ms, half of it after {half:.1f} ms idle)")
        for point, fitted in zip(measured.idle, measured.idle_fit.predicted):
            what = f"{point['gap_ms']:.0f} ms idle"
            lines.append(f"  {what:<22} {point['ms']:>11.2f} {point['excess_ms']:>10.2f} "
                         f"{fitted:>7.2f}")
    return "\n".join(lines)


def run_check(cfg: ProfileConfig, profile: SimProfile) -> Check:
    """The engine (as a co-located worker has it) against the simulator on `profile`."""
    from pdserve.engine.setup import build_engine

    workload = Workload(cfg.check, num_requests=cfg.check_requests)
    engine, _ = build_engine(cfg.model, role="colocated", dtype=cfg.dtype, device=cfg.device,
                             block_size=cfg.block_size, prefix_caching=False)
    try:
        return check(engine, profile, workload.requests(cfg.check_rate), cfg.check_rate)
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ProfileConfig, "profile", argv, prog="pdserve profile",
                       description=__doc__)
    try:
        if cfg.check:
            Workload(cfg.check)  # a bad spec is refused before anything is measured
        profile, measured = measure(cfg)
        checked = run_check(cfg, profile) if cfg.check else None
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"pdserve profile: {exc}", file=sys.stderr)
        return 2
    Path(cfg.out).write_text(json.dumps(dataclasses.asdict(profile), indent=1) + "\n")
    print(report(measured))
    print(f"wrote {cfg.out}: " + ", ".join(f"{f.name}={getattr(profile, f.name):.4g}"
                                           for f in dataclasses.fields(profile)))
    if checked is not None:
        print(checked.describe())
    if cfg.points_json:
        Path(cfg.points_json).write_text(json.dumps({
            "prefill": measured.prefill, "decode": measured.decode,
            "prefill_fit": dataclasses.asdict(measured.prefill_fit),
            "decode_fit": dataclasses.asdict(measured.decode_fit),
            "idle": measured.idle,
            "idle_fit": dataclasses.asdict(measured.idle_fit) if measured.idle_fit else None,
            "check": checked.as_dict() if checked is not None else None}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
