"""`pdserve plan`'s simulator on cases small enough to work out by hand: one request alone on
each path, prompts queueing on a prefill worker (shortest first, then by age), a decode batch's
TPOT, a prompt chunked beside a running decode, the router's placement and the profile's step
times."""

from __future__ import annotations

import json

import pytest
from pdserve.plan.cluster import Deployment, Outcome, Profiles, router_waits, simulate
from pdserve.plan.engine_model import EngineParams, EngineSim, Events, Job
from pdserve.plan.workload import Request
from pdserve.sim.profile import SimProfile

pytestmark = pytest.mark.unit

# prefill_ms(n) = 2 + 0.1 n; decode step of b = 5 + b; handoff of n tokens = 1 + 0.001 n ms
PROFILE = SimProfile(prefill_base_ms=2.0, prefill_ms_per_token=0.1, decode_base_ms=5.0,
                     decode_ms_per_seq=1.0, handoff_base_ms=1.0, handoff_gb_s=1.0,
                     kv_bytes_per_token=1000)
DISAGG = Deployment("disaggregated", 1, 1)


def run(dep: Deployment, *shapes: tuple[float, int, int], profile: SimProfile = PROFILE,
        cached: int = 0) -> list[Outcome]:
    """Each shape is (arrival ms, prompt tokens, output tokens)."""
    requests = [Request(i, at, prompt, out, cached) for i, (at, prompt, out) in enumerate(shapes)]
    return simulate(dep, requests, profile)


def test_one_request_alone_disaggregated_is_prefill_then_handoff_then_decode_steps():
    (r,) = run(DISAGG, (0.0, 300, 4))
    # prefill 2 + 30 = 32 ms in one chunk (512), handoff 1 + 0.3 ms, decode idle: joins at once
    assert r.ttft_ms == pytest.approx(33.3)
    assert r.tpot_ms == pytest.approx(6.0)  # three decode steps of one sequence: 5 + 1
    assert r.e2e_ms == pytest.approx(33.3 + 18.0)
    assert r.workers == "prefill0 -> decode0"


def test_a_chunked_prompt_ships_each_chunk_as_it_ends_and_lands_after_the_last():
    (r,) = run(Deployment("disaggregated", 1, 1, chunk_size=128), (0.0, 300, 1))
    # chunks 128, 128, 44: steps of 14.8, 14.8 and 6.4 ms; each shipment after its chunk
    # (1.128, 1.128, 1.044 ms) and after the one before: the last lands at 36.0 + 1.044
    assert r.ttft_ms == pytest.approx(37.044)
    assert r.tpot_ms is None and r.e2e_ms == r.ttft_ms


def test_request_overhead_is_added_to_every_ttft():
    profile = SimProfile(**{**json.loads(json.dumps(PROFILE.__dict__)),
                            "request_overhead_ms": 2.5})
    (r,) = run(DISAGG, (0.0, 300, 4), profile=profile)
    assert r.ttft_ms == pytest.approx(35.8) and r.tpot_ms == pytest.approx(6.0)


def test_a_short_uncached_prompt_is_prefilled_by_the_decode_worker():
    (r,) = run(DISAGG, (0.0, 100, 2))  # 100 < --remote-prefill-min-tokens 256: no handoff
    assert r.ttft_ms == pytest.approx(12.0)  # 2 + 10, the whole prompt in one step
    assert r.workers == "decode0"
    (r,) = run(Deployment("disaggregated", 1, 1, remote_prefill_min_tokens=0), (0.0, 100, 2))
    assert r.workers == "prefill0 -> decode0" and r.ttft_ms == pytest.approx(12.0 + 1.1)


def test_cached_prefix_tokens_are_neither_computed_nor_shipped():
    dep = Deployment("disaggregated", 1, 1, remote_prefill_min_tokens=0)
    (r,) = run(dep, (0.0, 300, 1), cached=144)
    assert r.ttft_ms == pytest.approx(2 + 15.6 + 1 + 0.156)  # 156 tokens computed and shipped


def test_two_simultaneous_prompts_on_one_prefill_worker_queue_in_order():
    a, b = run(DISAGG, (0.0, 300, 4), (0.0, 300, 4))
    # the first arrival starts a step at once; the second waits for the next step
    assert a.ttft_ms == pytest.approx(33.3)
    assert b.ttft_ms == pytest.approx(32 + 32 + 1.3)
    assert b.tpot_ms == pytest.approx(6.0)  # a had finished decoding (at 51.3) before b landed


def test_a_handed_off_sequence_joins_the_decode_batch_between_two_steps():
    a, b = run(DISAGG, (0.0, 300, 8), (0.0, 300, 2))
    # a decodes from 33.3 in steps of 6 ms; b lands at 65.3, mid-step: its first token is on
    # the stream when that step ends (69.3), and the next step (7 ms) has both
    assert b.ttft_ms == pytest.approx(69.3)
    assert b.e2e_ms == a.e2e_ms == pytest.approx(76.3)


def test_prefill_worker_takes_the_shortest_remaining_prompt_first():
    dep = Deployment("disaggregated", 1, 1, max_prefill_tokens=512)
    long, short = run(dep, (0.0, 1000, 1), (1.0, 300, 1))
    # step 1 (0 - 53.2): 512 of the long prompt; step 2: the short one first (300 tokens) and
    # 212 more of the long one, 53.2 ms; the short one lands 1.3 ms after that
    assert short.ttft_ms == pytest.approx(106.4 + 1.3 - 1.0)
    assert long.ttft_ms > short.ttft_ms + 1.0


def test_prefill_worker_serves_prompts_waiting_past_the_age_bound_oldest_first():
    dep = Deployment("disaggregated", 1, 1, max_prefill_tokens=512, prefill_age_ms=0.0)
    long, short = run(dep, (0.0, 1000, 1), (1.0, 300, 1))
    # every prompt is aged: arrival order, so step 2 finishes the long one (488 tokens) and
    # gives the short one the 24 left; shipments 512 then 488 tokens
    assert long.ttft_ms == pytest.approx(106.4 + 1.488)
    assert short.ttft_ms > long.ttft_ms


def test_decode_tpot_is_the_step_time_of_its_batch():
    events = Events()
    done: dict[int, float] = {}
    first: dict[int, float] = {}
    profile = SimProfile(decode_base_ms=5.0, decode_ms_per_seq=1.0,
                         decode_ms_per_attended_token=0.01)
    engine = EngineSim("d", EngineParams("decode"), profile, events,
                       on_first_token=lambda j, t: first.__setitem__(j.index, t),
                       on_done=lambda j, t: done.__setitem__(j.index, t),
                       on_handed_off=lambda j, t: None)
    for i in range(2):
        engine.reserved += 1
        events.at(0.0, engine.admit, Job(i, 0.0, 10, 3, computed=10))
    events.run()
    # 0 - 6.11: job 0 alone (5 + 1 + 0.01 x 11); job 1, admitted during that step, is on the
    # stream at its end; 6.11 - 13.34: both (5 + 2 + 0.01 x (12 + 11)), job 0's last token;
    # then job 1 alone (5 + 1 + 0.01 x 12)
    assert first == {0: 0.0, 1: pytest.approx(6.11)}
    assert done == {0: pytest.approx(6.11 + 7.23), 1: pytest.approx(6.11 + 7.23 + 6.12)}
    assert engine.steps == 3 and engine.reserved == 0 and not engine.running


def test_decode_steps_taken_back_to_back_give_the_same_times_as_one_event_each():
    # a single long decode: steps are skipped ahead between events; a second request arriving
    # mid-run must see the step in progress and join after it
    (a,) = run(DISAGG, (0.0, 300, 101))
    assert a.e2e_ms == pytest.approx(33.3 + 100 * 6.0)
    a, b = run(DISAGG, (0.0, 300, 101), (100.0, 300, 2))
    # b lands at 100 + 33.3 = 133.3; a's steps end at 33.3 + 6k: 135.3 is the one in progress
    assert b.ttft_ms == pytest.approx(135.3 - 100.0)
    assert b.e2e_ms == pytest.approx(135.3 + 7.0 - 100.0)


def test_colocated_prompt_is_chunked_beside_a_running_decode():
    a, b = run(Deployment("colocated", 0, 1, chunk_size=100), (0.0, 50, 10), (10.0, 250, 2))
    # t=0: A alone, whole prompt (2 + 5 = 7 ms); 7-13: A decodes (6 ms); B arrived at 10: from
    # 13 its chunks of 100, 100, 50 ride beside A (5 + 10 + 1, 16, 11 ms): B's token at 56;
    # 56-63: A and B decode (7 ms), B ends; A alone four more steps of 6 ms: A ends at 87
    assert a.ttft_ms == pytest.approx(7.0)
    assert b.ttft_ms == pytest.approx(56.0 - 10.0)
    assert b.e2e_ms == pytest.approx(63.0 - 10.0)
    assert a.e2e_ms == pytest.approx(87.0)
    assert a.tpot_ms == pytest.approx(80.0 / 9)


def test_colocated_worker_packs_waiting_prompts_into_one_step_without_decodes():
    # A arrives alone (its step: 2 + 30); B and C wait for it, then go together in one step
    # beside A's decode: 5 + 0.1 x 600 + 1 = 66 ms
    a, b, c = run(Deployment("colocated", 0, 1), (0.0, 300, 2), (1.0, 300, 1), (1.0, 300, 1))
    assert a.ttft_ms == pytest.approx(32.0)
    assert b.ttft_ms == c.ttft_ms == pytest.approx(32.0 + 66.0 - 1.0)
    assert a.e2e_ms == pytest.approx(98.0)


def test_decode_max_num_seqs_refuses_what_no_worker_has_room_for():
    dep = Deployment("disaggregated", 1, 1, max_num_seqs=1)
    a, b = run(dep, (0.0, 300, 50), (1.0, 300, 2))
    assert a.ok and not b.ok  # the only decode worker holds one sequence


def test_router_spreads_simultaneous_requests_over_decode_and_prefill_workers():
    outcomes = run(Deployment("disaggregated", 2, 2), *[(0.0, 300, 2)] * 4)
    pairs = [o.workers for o in outcomes]
    assert sorted(p.split(" -> ")[1] for p in pairs) == ["decode0", "decode0", "decode1",
                                                         "decode1"]
    assert sorted(p.split(" -> ")[0] for p in pairs) == ["prefill0", "prefill0", "prefill1",
                                                         "prefill1"]
    assert max(o.ttft_ms or 0 for o in outcomes) == pytest.approx(32 + 32 + 1.3)


def test_profile_defaults_keep_the_simulated_workers_times():
    p = SimProfile()
    assert p.prefill_ms(960) == pytest.approx(2.0 + 0.06 * 960)
    assert p.decode_step_ms(4) == pytest.approx(3.4)
    assert p.handoff_ms(3_000_000) == pytest.approx(1.5)
    assert p.tp_speedup(4) == 1.0  # not modelled unless the profile says so
    assert SimProfile(tp_efficiency=0.8).tp_speedup(2) == pytest.approx(1.8)


def test_step_ms_splits_a_prompt_into_chunks_at_the_same_attention_cost():
    p = SimProfile(prefill_ms_per_attended_token=0.001, decode_ms_per_attended_token=0.002)
    chunks = [(0, 128), (128, 128), (256, 44)]
    attention = sum(p.step_ms(0, 0, [c]) - p.prefill_base_ms - p.prefill_ms_per_token * c[1]
                    for c in chunks)
    assert attention == pytest.approx(0.001 * 300 * 301 / 2)
    assert p.step_ms(0, 0, [(0, 300)]) == pytest.approx(p.prefill_ms(300))
    assert p.step_ms(3, 90, []) == pytest.approx(p.decode_step_ms(3, 90)) == \
        pytest.approx(3.0 + 0.3 + 0.18)
    # both: the larger base once, each part's per-token costs
    assert p.step_ms(3, 90, [(0, 10)]) == pytest.approx(3.0 + 0.6 + 0.055 + 0.3 + 0.18)


def test_the_first_step_after_idleness_pays_the_wake_and_a_busy_worker_does_not():
    waking = SimProfile(**{**PROFILE.__dict__, "idle_wake_ms": 4.0, "idle_wake_half_ms": 10.0})
    assert waking.wake_ms(None) == 4.0 and waking.wake_ms(10.0) == pytest.approx(2.0)
    assert PROFILE.wake_ms(None) == PROFILE.wake_ms(1e6) == 0.0  # not modelled: no change
    colocated = Deployment("colocated", 0, 1)
    first, second, third = run(colocated, (0.0, 100, 1), (50.0, 100, 1), (51.0, 100, 1),
                               profile=waking)
    # a cold start wakes fully: 4 + prefill 2 + 10; idle 16..50 = 34 ms: 4 x 34 / 44 more
    assert first.ttft_ms == pytest.approx(16.0)
    assert second.ttft_ms == pytest.approx(4 * 34 / 44 + 12.0)
    # the third arrives while the second computes: queued, no wake (ends at 50 + 3.09 + 24)
    assert third.ttft_ms == pytest.approx(50.0 + 4 * 34 / 44 + 24.0 - 51.0)
    (alone,) = run(DISAGG, (0.0, 300, 4), profile=waking)
    # both workers start cold: the prefill 4 + 32, handoff 1.3; the decode worker's first
    # token came with the handoff, its three steps start after its own wake of 4
    assert alone.ttft_ms == pytest.approx(37.3)
    assert alone.e2e_ms == pytest.approx(37.3 + 4.0 + 18.0)


def test_profile_file_with_the_new_fields_loads(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"decode_ms_per_attended_token": 0.001, "devices_per_worker": 2}))
    p = SimProfile.load(path)
    assert p.decode_ms_per_attended_token == 0.001 and p.devices_per_worker == 2
    assert p.prefill_base_ms == SimProfile().prefill_base_ms
    with pytest.raises(ValueError, match="devices_per_worker"):
        SimProfile(devices_per_worker=0)


def test_prefill_and_decode_workers_may_have_profiles_of_their_own():
    slow_decode = SimProfile(**{**PROFILE.__dict__, "decode_ms_per_seq": 3.0})
    two_cores = SimProfile(**{**PROFILE.__dict__, "devices_per_worker": 2.0,
                              "handoff_base_ms": 4.0})
    profiles = Profiles(PROFILE, prefill=two_cores, decode=slow_decode)
    (r,) = simulate(DISAGG, [Request(0, 0.0, 300, 4, 0)], profiles)
    assert r.ttft_ms == pytest.approx(32 + 4.3)  # the prefill worker's handoff
    assert r.tpot_ms == pytest.approx(8.0)       # the decode worker's steps
    (c,) = simulate(Deployment("colocated", 0, 1), [Request(0, 0.0, 300, 4, 0)], profiles)
    assert c.tpot_ms == pytest.approx(6.0)       # co-located workers: the default profile
    assert profiles.devices(Deployment("disaggregated", 2, 3, tp=2)) == 2 * (2 * 2 + 3 * 1)
    assert profiles.devices(Deployment("colocated", 0, 3)) == 3


def test_idle_prefill_workers_take_turns_as_the_router_spreads_ties():
    outcomes = run(Deployment("disaggregated", 2, 1), *[(100.0 * i, 300, 2) for i in range(4)])
    assert [o.workers.split(" -> ")[0] for o in outcomes] == \
        ["prefill0", "prefill1", "prefill0", "prefill1"]


def test_requests_wait_for_a_free_router_core_in_arrival_order():
    priced = SimProfile(router_ms_per_request=10.0)
    at = [Request(0, 0.0, 300, 4, 0), Request(1, 1.0, 300, 4, 0), Request(2, 2.0, 300, 4, 0)]
    # one core, 10 ms each: the second starts at 10 (waited 9), the third at 20 (waited 18)
    assert router_waits(at, priced, 1) == pytest.approx([0.0, 9.0, 18.0])
    # two cores: the third takes the first one freed, at 10
    assert router_waits(at, priced, 2) == pytest.approx([0.0, 0.0, 8.0])
    # and 1 ms per streamed token: 14 ms a request of 4 tokens
    per_token = SimProfile(router_ms_per_request=10.0, router_ms_per_token=1.0)
    assert router_waits(at, per_token, 1) == pytest.approx([0.0, 13.0, 26.0])
    # given out of arrival order, served in it: each wait stays with its request
    assert router_waits(at[::-1], priced, 1) == pytest.approx([18.0, 9.0, 0.0])
    assert router_waits(at, PROFILE, 1) == [0.0, 0.0, 0.0]  # no router CPU priced: no queue


def test_a_request_waiting_for_a_router_core_starts_that_much_later():
    priced = SimProfile(**{**json.loads(json.dumps(PROFILE.__dict__)),
                           "router_ms_per_request": 10.0})
    requests = [Request(0, 0.0, 300, 1, 0), Request(1, 0.0, 300, 1, 0)]
    # co-located x2, one prompt each (2 + 30 ms): the second waits 10 ms for the one router
    a, b = simulate(Deployment("colocated", 0, 2), requests, priced)
    assert a.ttft_ms == pytest.approx(32.0) and b.ttft_ms == pytest.approx(42.0)
    assert a.workers != b.workers
    a, b = simulate(Deployment("colocated", 0, 2, routers=2), requests, priced)
    assert a.ttft_ms == pytest.approx(32.0) and b.ttft_ms == pytest.approx(32.0)
    with pytest.raises(ValueError, match="routers=0"):
        Deployment("colocated", 0, 1, routers=0)
