"""`pdserve generate`'s TTFT breakdown says how the prompt's KV reached the decode side."""

from __future__ import annotations

import pytest
from pdserve.client import breakdown
from pdserve.v1 import router_pb2

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("fields, line", [
    ({"kv_transport": "shm", "kv_pages": 2, "prompt_pages": 3, "kv_bytes": 8192,
      "kv_transfer_total_ms": 1.25},
     "KV handoff: 2 of 3 prompt pages, 8,192 bytes over shm (moving them took 1.2 ms); "),
    ({"prefill_on": "decode"},
     "no KV handoff: the decode worker prefilled the uncached part itself; "),
    ({"kv_transport": "local", "prefill_on": "prefill"},  # a co-located worker (no pages move)
     "no KV handoff: one co-located engine prefilled and decodes; "),
])
def test_the_handoff_line_names_what_happened(fields, line):
    t = router_pb2.Timing(ttft_ms=10, prefill_worker="p", decode_worker="d", **fields)
    assert breakdown(t).splitlines()[1] == line + "prefill p, decode d"


def test_the_parts_and_the_rest_add_up_to_ttft():
    t = router_pb2.Timing(ttft_ms=20, queue_ms=1, prefill_ms=10, kv_transfer_ms=2,
                          decode_start_ms=3)
    assert breakdown(t).splitlines()[0] == (
        "TTFT 20.0 ms = queue 1.0 + prefill 10.0 + kv_transfer 2.0 + decode_start 3.0 "
        "(+ 4.0 router/network)")
