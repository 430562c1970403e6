"""CPU lists, the cgroup-aware CPU allowance, how `pdserve up` splits cores between prefill
and decode, and the warm-up request each worker runs before it reports SERVING."""

from __future__ import annotations

import os

import pytest
from pdserve.common.cpus import (
    cgroup_quota,
    cpu_allowance,
    format_cpu_list,
    parse_cpu_list,
    partition,
)
from pdserve.engine.loop import EngineLoop
from pdserve.engine.setup import build_engine
from pdserve.up import UpConfig
from pdserve.worker.warmup import warm_up

pytestmark = pytest.mark.unit


def test_cpu_lists_round_trip():
    assert parse_cpu_list("0-3,6, 8-9") == [0, 1, 2, 3, 6, 8, 9]
    assert format_cpu_list([9, 0, 1, 2, 3, 6, 8]) == "0-3,6,8-9"
    assert format_cpu_list([4]) == "4"
    for bad in ("", "a", "3-1", "-2"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpu_list(bad)


def test_allowance_follows_the_cgroup_quota(tmp_path):
    cores = len(os.sched_getaffinity(0))
    assert cgroup_quota(tmp_path) is None and cpu_allowance(tmp_path) == cores
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # a 1.5-core limit
    assert cgroup_quota(tmp_path) == 1.5 and cpu_allowance(tmp_path) == min(cores, 2)
    (tmp_path / "cpu.max").write_text("10000 100000\n")
    assert cpu_allowance(tmp_path) == 1


def test_partition_gives_each_side_its_own_cores():
    two = partition([0, 1])
    assert (two.prefill, two.decode, two.others) == ([0], [1], [0, 1])
    eight = partition(list(range(8)))
    assert eight.others == [7] and not set(eight.prefill) & set(eight.decode)
    assert sorted(eight.prefill + eight.decode) == list(range(7))
    assert partition([3]).prefill == partition([3]).decode == [3]
    skewed = partition(list(range(8)), decode_share=0.25)
    assert len(skewed.decode) == 2 and len(skewed.prefill) == 5


def test_up_partitions_only_in_disaggregated_mode():
    assert UpConfig(colocated=True).cpu_plan() is None
    assert UpConfig(cpu_partition=False).cpu_plan() is None
    explicit = UpConfig(prefill_cpus="0", decode_cpus="1").cpu_plan()
    assert explicit is not None and (explicit.prefill, explicit.decode) == ([0], [1])
    with pytest.raises(ValueError, match="prefill_cpus='x'"):
        UpConfig(prefill_cpus="x")


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_warm_up_runs_and_frees_everything(cache_dir, role):
    engine, _ = build_engine("tiny", role=role, num_pages=32, max_model_len=512)
    loop = EngineLoop(engine).start()
    try:
        assert warm_up(loop, role) > 0
        assert engine.allocator.num_free == 32 and not engine.seqs and not engine.has_work()
        assert engine.allocator.num_cached == 0  # no made-up (decode: garbage) KV is reused
    finally:
        loop.stop()
        engine.close()
