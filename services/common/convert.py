"""Proto ↔ domain conversions shared by the worker servicers (one place, not in every handler)."""

from __future__ import annotations

from pdserve.common.errors import InvalidArgument
from pdserve.v1 import common_pb2


def sampling_from_pb(pb: common_pb2.SamplingParams):
    """SamplingParams from the wire; a bad value becomes INVALID_ARGUMENT naming the field."""
    from pdserve.engine.sampling import SamplingParams

    try:
        return SamplingParams(max_tokens=pb.max_tokens, temperature=pb.temperature, top_p=pb.top_p,
                              top_k=pb.top_k, seed=pb.seed if pb.HasField("seed") else None,
                              ignore_eos=pb.ignore_eos)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
