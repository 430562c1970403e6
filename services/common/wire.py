"""Proto <-> plain types for the messages of common.proto: the one place where the wire form
of sampling parameters, a ticket, a layout, a destination or a transfer report is read or
written (router, worker servicers, agent client)."""

from __future__ import annotations

import dataclasses

from pdserve.common.errors import InvalidArgument
from pdserve.common.handoff import Destination, RankTransfer, TransferReport
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.sampling import SamplingParams
from pdserve.common.tickets import TicketKey
from pdserve.v1 import common_pb2


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """SamplingParams from the wire; a bad value becomes INVALID_ARGUMENT naming the field."""
    try:
        return SamplingParams(max_tokens=pb.max_tokens, temperature=pb.temperature, top_p=pb.top_p,
                              top_k=pb.top_k, seed=pb.seed if pb.HasField("seed") else None,
                              ignore_eos=pb.ignore_eos)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p,
                                   top_k=params.top_k, ignore_eos=params.ignore_eos,
                                   max_tokens=params.max_tokens)
    if params.seed is not None:
        pb.seed = params.seed
    return pb


def ticket_from_pb(pb: common_pb2.Ticket) -> TicketKey:
    return TicketKey(pb.request_id, pb.epoch)


def ticket_to_pb(key: TicketKey, decode_worker: str = "") -> common_pb2.Ticket:
    return common_pb2.Ticket(request_id=key.request_id, epoch=key.epoch,
                             decode_worker=decode_worker)


def fingerprint_to_pb(fp: LayoutFingerprint) -> common_pb2.LayoutFingerprint:
    return common_pb2.LayoutFingerprint(**dataclasses.asdict(fp))


def fingerprint_from_pb(pb: common_pb2.LayoutFingerprint) -> LayoutFingerprint | None:
    """None when the message is unset; INVALID_ARGUMENT when it is not a valid layout."""
    if not pb.model_id and not pb.num_layers:
        return None
    try:
        return LayoutFingerprint(**{f.name: getattr(pb, f.name)
                                    for f in dataclasses.fields(LayoutFingerprint)})
    except ValueError as exc:
        raise InvalidArgument(f"fingerprint: {exc}") from None


def destination_to_pb(dest: Destination) -> common_pb2.KVDestination:
    pb = common_pb2.KVDestination(agent_address=dest.agent_address,
                                  agent_epoch=dest.agent_epoch, pool_id=dest.pool_id,
                                  page_ids=list(dest.page_ids), first_page=dest.first_page,
                                  boundary_key=dest.boundary_key)
    if dest.fingerprint is not None:
        pb.fingerprint.CopyFrom(fingerprint_to_pb(dest.fingerprint))
    for r in dest.ranks:
        rank = pb.tp_ranks.add(pool_id=r.pool_id)
        if r.fingerprint is not None:
            rank.fingerprint.CopyFrom(fingerprint_to_pb(r.fingerprint))
    return pb


def destination_from_pb(pb: common_pb2.KVDestination) -> Destination:
    if pb.first_page < 0:
        raise InvalidArgument(f"destination.first_page={pb.first_page}: must be >= 0")
    ranks = tuple(Destination(pb.agent_address, pb.agent_epoch, r.pool_id, (),
                              fingerprint_from_pb(r.fingerprint)) for r in pb.tp_ranks)
    return Destination(pb.agent_address, pb.agent_epoch, pb.pool_id, tuple(pb.page_ids),
                       fingerprint_from_pb(pb.fingerprint), pb.first_page, pb.boundary_key,
                       ranks)


def report_to_pb(report: TransferReport) -> common_pb2.TransferReport:
    return common_pb2.TransferReport(handoff_ms=report.handoff_ms, kv_bytes=report.kv_bytes,
                                     kv_pages=report.kv_pages, transport=report.transport,
                                     num_runs=report.num_runs,
                                     kv_transfer_total_ms=report.total_ms,
                                     ranks=[rank_to_pb(r) for r in report.ranks])


def rank_to_pb(r: RankTransfer) -> common_pb2.RankTransfer:
    return common_pb2.RankTransfer(**dataclasses.asdict(r))


def rank_from_pb(pb: common_pb2.RankTransfer) -> RankTransfer:
    return RankTransfer(pb.decode_rank, pb.prefill_rank_first, pb.prefill_rank_last,
                        pb.kv_bytes, pb.handoff_ms, pb.total_ms, pb.transport, pb.relayout)


def report_from_pb(pb: common_pb2.TransferReport) -> TransferReport:
    """A report; one from a sender that predates kv_transfer_total_ms (0) was not pipelined,
    so its whole transfer is its handoff."""
    return TransferReport(pb.handoff_ms, pb.kv_bytes, pb.kv_pages, pb.transport, pb.num_runs,
                          pb.kv_transfer_total_ms or pb.handoff_ms,
                          tuple(rank_from_pb(r) for r in pb.ranks))
