"""`pdserve plan --validate`'s real side on the tiny model: `pdserve up` runs 1P+1D, `pdserve
bench serve` sends it the calibration, CPU, core-sampling and measured runs, and every run
draws prompts of its own (a prompt sent twice would be a prefix-cache hit: prefilled on the
decode worker, no handoff, and not what the prediction is for)."""

from __future__ import annotations

import json

import pytest
from pdserve.plan import stacks
from pdserve.plan.cluster import Deployment
from pdserve.plan.workload import Workload

pytestmark = pytest.mark.service


def test_a_disaggregated_stack_is_calibrated_and_measured_once_per_seed(tiny_model_dir,
                                                                        tmp_path):
    workload = Workload("fixed:40,4", seed=7)
    runner = stacks.StackRunner(str(tiny_model_dir), workload, 6, tmp_path, repeats=2)
    alone, runs = runner(Deployment("disaggregated", 1, 1, remote_prefill_min_tokens=0), 4.0)
    assert alone.ttft_p50_ms and alone.tpot_p50_ms and alone.prefill_p50_ms
    assert alone.cpu_ms_per_token and alone.cpu_ms_per_token > 0
    assert alone.shared is not None and set(alone.shared) == {"prefill", "decode"}
    assert [cores for _, cores in alone.shared.values()] == [1.0, 1.0]  # one core each
    # the decode worker's steps during the run at the rate: 6 requests, 3 tokens each after
    # the first (the prefill worker's), and the time they and the loop between them took
    assert alone.steps is not None and alone.steps.num_decoded == 6 * 3
    assert alone.steps.seconds > 0 and alone.steps.held_s > 0
    assert len(runs) == 2 and all(r.ttft_p50_ms and r.tpot_p50_ms for r in runs)
    counts = []
    for run in ("-calibration", "-cpu", "-cores", "", "-2"):
        doc = json.loads((tmp_path / f"bench-1P+1D-chunk-512{run}.json").read_text())
        records = doc["runs"][0]["records"]
        assert records and all(r["ok"] for r in records)
        # every prompt went through the prefill worker: none was found in the prefix cache
        assert [r["cached_tokens"] for r in records] == [0] * len(records), run
        assert all(r["workers"].startswith("prefill@") for r in records), run
        counts.append(len(records))
    assert counts == [8, 16, 6, 6, 6]
