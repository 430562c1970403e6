"""The ids the workers see per attempt, and the client's id recovered from them (spans and
outcome lines label requests with the client's id)."""

from __future__ import annotations

import logging

import pytest
from pdserve.common import requestids
from pdserve.common.logs import outcome
from pdserve.common.requestids import attempt_id, client_id, labelled, new_nonce

pytestmark = pytest.mark.unit


def test_every_attempt_of_every_request_has_its_own_id():
    a, b = new_nonce(), new_nonce()
    ids = {attempt_id("same", n, nonce) for n in (1, 2) for nonce in (a, b)}
    assert len(ids) == 4 and all(i.startswith("same#") for i in ids)
    assert attempt_id("r", 2, "0123abcd") == "r#2.0123abcd"


@pytest.mark.parametrize("rid", ["r", "a#b", "x#1", "x#1.0123abc", "with spaces #2.zzzzzzzz", ""])
def test_the_client_id_comes_back_out_of_any_attempt_id(rid):
    assert client_id(attempt_id(rid, 3, new_nonce())) == rid
    assert client_id(rid) == rid  # not an attempt id: as it is


def test_spans_and_outcome_lines_carry_the_clients_id(caplog):
    rid = attempt_id("client-7", 2, "deadbeef")
    assert labelled({"request_id": rid, "n": 1}) == {
        "request_id": "client-7", "attempt_id": rid, "n": 1}
    assert labelled({"request_id": "client-7"}) == {"request_id": "client-7"}
    with caplog.at_level(logging.INFO):
        outcome(logging.getLogger("t"), "prefill", request_id=rid)
    assert caplog.messages == [f"prefill request_id=client-7 attempt_id={rid}"]
    assert requestids.client_id("client-7#2.deadbeef") == "client-7"
