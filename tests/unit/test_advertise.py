"""What peers on other hosts are told: the agent address decode workers hand out in
reservations, worker ids, and the sender's name in a KV write header."""

from __future__ import annotations

import pytest
from pdserve.common.config import parse_config
from pdserve.common.kv.wire import WriteHeader
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey
from pdserve.decode.main import DecodeConfig
from pdserve.worker.main import worker_name

pytestmark = pytest.mark.unit


def decode_config(*argv: str) -> DecodeConfig:
    return parse_config(DecodeConfig, "decode", list(argv), env={})


@pytest.mark.parametrize("kv_agent, advertise_host, for_peers", [
    # the agent beside the worker (a pod's sidecar): reached by other hosts at the pod IP
    ("127.0.0.1:50081", "10.1.2.3", "10.1.2.3:50081"),
    ("localhost:50081", "10.1.2.3", "10.1.2.3:50081"),
    ("[::1]:50081", "fd00::7", "[fd00::7]:50081"),
    # an agent named by a routable address is handed out as it is
    ("10.9.9.9:50081", "10.1.2.3", "10.9.9.9:50081"),
    # everything on one host (the defaults, `pdserve up`): loopback stays loopback
    ("127.0.0.1:50081", "127.0.0.1", "127.0.0.1:50081"),
])
def test_reservations_name_the_agent_as_other_hosts_reach_it(kv_agent, advertise_host,
                                                              for_peers):
    cfg = decode_config("--kv-agent", kv_agent, "--advertise-host", advertise_host)
    assert cfg.kv_agent_for_peers == for_peers


def test_worker_id_names_the_advertised_host():
    cfg = decode_config("--advertise-host", "10.1.2.3", "--host", "0.0.0.0")
    assert worker_name("decode", cfg) == "decode@10.1.2.3:50071"


@pytest.mark.parametrize("argv, needle", [
    (["--advertise-host", "0.0.0.0"], "advertise_host='0.0.0.0'"),
    (["--advertise-host", "::"], "advertise_host='::'"),
    (["--kv-agent", "0.0.0.0:50081"], "kv_agent='0.0.0.0:50081'"),
    (["--kv-agent", "agent"], "kv_agent='agent'"),
])
def test_unreachable_advertised_addresses_are_refused(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        decode_config(*argv)
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_write_header_carries_the_sender_agent():
    fp = LayoutFingerprint("m", "r", "float32", 2, 2, 16, 4, 0, 1)
    header = WriteHeader(1, TicketKey("req", 3), 5, "decode-0/1", fp, 1024, ((3, 2),), 1000.0,
                         sender="kv-host-a")
    assert WriteHeader.decode(header.encode()).sender == "kv-host-a"
    unnamed = WriteHeader(1, TicketKey("req", 3), 5, "decode-0/1", fp, 1024, ((3, 2),), 1000.0)
    assert b"sender" not in unnamed.encode() and WriteHeader.decode(unnamed.encode()).sender == ""
