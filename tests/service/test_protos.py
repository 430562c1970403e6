"""The committed stubs in services/v1 are what protoc makes of protos/ (no drift)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.service
ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_protos():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_stubs_import_as_pdserve_v1_with_every_service():
    from pdserve.v1 import decode_pb2, kvtransfer_pb2, prefill_pb2, router_pb2

    services = {name for mod in (router_pb2, prefill_pb2, decode_pb2, kvtransfer_pb2)
                for name in mod.DESCRIPTOR.services_by_name}
    assert services == {"Router", "RouterPeers", "Prefill", "Decode", "KVTransfer"}
    assert router_pb2.DESCRIPTOR.package == "pdserve.v1"
