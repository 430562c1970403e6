"""`pdserve profile` on the tiny built-in model: the real engine timed in this process, the
profile written, loadable by `pdserve plan`, and its models reproducing the measured steps
(and the first steps after idle spells)."""

from __future__ import annotations

import json
import statistics

import pytest
from pdserve.plan import measure
from pdserve.sim.profile import SimProfile

pytestmark = pytest.mark.service

# Step times of a tiny model on a shared 2-core machine are a millisecond or two and jitter
# by tens of percent; a linear fit of them is held to this median relative error per point.
FIT_TOLERANCE = 0.35


def test_profile_measures_fits_and_writes_a_loadable_profile(tiny_model_dir, tmp_path, capsys):
    out, points = tmp_path / "profile.json", tmp_path / "points.json"
    assert measure.main(["--model", str(tiny_model_dir), "--threads", "1", "--repeats", "3",
                         "--prompt-lengths", "16,64,256", "--decode-batches", "1,4",
                         "--contexts", "32,256", "--out", str(out),
                         "--points-json", str(points), "--check", "fixed:64,8",
                         "--check-rate", "20", "--check-requests", "12"]) == 0
    profile = SimProfile.load(out)
    doc = json.loads(points.read_text())
    assert len(doc["prefill"]) == 3 * 2 and len(doc["decode"]) == 2 * 2
    assert profile.kv_bytes_per_token > 0 and profile.devices_per_worker == 1.0
    assert profile.handoff_gb_s > 0 and profile.block_size == 16
    # the written models are the fit: they give its predictions for every measured point
    for point, fitted in zip(doc["prefill"], doc["prefill_fit"]["predicted"]):
        k, n = int(point["batch"]), int(point["length"])
        assert profile.step_ms(0, 0, [(0, n)] * k) == pytest.approx(fitted, rel=1e-9)
    for point, fitted in zip(doc["decode"], doc["decode_fit"]["predicted"]):
        assert profile.decode_step_ms(int(point["batch"]), int(point["context_tokens"])) == \
            pytest.approx(fitted, rel=1e-9)
    # ... and the fit reproduces the measured times
    errors = [abs(f - p["ms"]) / p["ms"] for kind in ("prefill", "decode")
              for p, f in zip(doc[kind], doc[f"{kind}_fit"]["predicted"])]
    assert statistics.median(errors) <= FIT_TOLERANCE, errors
    # a step after each idle spell, against one back to back: the wake written is their fit
    assert [i["gap_ms"] for i in doc["idle"]] == [2, 10, 50, 200]
    assert [profile.idle_wake_ms, profile.idle_wake_half_ms] == doc["idle_fit"]["coefficients"]
    for point, fitted in zip(doc["idle"], doc["idle_fit"]["predicted"]):
        assert point["excess_ms"] == pytest.approx(point["ms"] - point["back_to_back_ms"])
        assert profile.wake_ms(point["gap_ms"]) == pytest.approx(fitted, rel=1e-9)
    printed = capsys.readouterr().out
    assert "prefill step" in printed and "ms idle" in printed
    assert "check: 12 requests at 20 req/s" in printed
    # the replay through the engine and the simulator on the new profile: the same order of
    # magnitude (a sanity bound; accuracy on a quiet machine is in docs/planning.md)
    check = doc["check"]
    for name in ("ttft_p50_ms", "tpot_p50_ms"):
        measured, predicted = check[name]
        assert measured > 0 and predicted > 0
        assert 1 / 3 < predicted / measured < 3, check


def test_profile_refuses_bad_options():
    with pytest.raises(SystemExit) as exc:
        measure.main(["--prompt-lengths", "0,x"])
    assert exc.value.code == 2
