"""Security pieces alone: API-key checks, TLS options, write grants, the grant on the wire, the
certificates `pdserve certs create` writes. No sockets, no processes."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from pdserve.certs import CertPaths, create
from pdserve.common.config import ServerConfig, TlsOptions
from pdserve.common.kv.errors import Unauthorized
from pdserve.common.kv.wire import WriteHeader
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.security import (
    ApiKeys,
    ChannelSecurity,
    KeyFile,
    bearer_token,
    load_api_keys,
)
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.grants import GrantBook

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return create(tmp_path_factory.mktemp("certs"), hosts=["pdserve.internal", "10.1.2.3"])


# --- API keys ------------------------------------------------------------------------------

def test_api_keys_accept_only_listed_bearer_tokens(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# rotated monthly\nalpha-key\n\n  beta-key  \n")
    keys = ApiKeys.from_file(str(path))
    assert keys.check("Bearer alpha-key") is None
    assert keys.check("bearer beta-key") is None
    assert keys.check(None) == "missing API key: send the header 'authorization: Bearer <key>'"
    assert keys.check("Basic YWxwaGE=") == "malformed authorization header: expected 'Bearer <key>'"
    assert keys.check("Bearer ") == "malformed authorization header: expected 'Bearer <key>'"
    assert keys.check("Bearer alpha-key2") == "invalid API key"
    assert keys.check("Bearer # rotated monthly") == "invalid API key"
    assert bearer_token("Bearer  x ") == "x"


def test_an_api_key_file_without_keys_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match=f"{path}: no API key in the file"):
        load_api_keys(str(path))


def test_api_keys_rotate_without_a_restart_and_survive_a_broken_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("old-key\n")
    clock = Clock()
    keys = KeyFile(str(path), recheck_s=1.0, clock=clock)

    def rewrite(text: str, mtime_s: int) -> None:
        path.write_text(text)
        os.utime(path, (mtime_s, mtime_s))  # a visible change, whatever the clock's resolution

    rewrite("old-key\nnew-key\n", 1_000)
    assert keys.check("Bearer new-key") == "invalid API key"  # looked at once a second
    clock.now += 1.0
    assert keys.check("Bearer new-key") is None and keys.check("Bearer old-key") is None
    rewrite("new-key\n", 2_000)
    clock.now += 1.0
    assert keys.check("Bearer old-key") == "invalid API key"
    rewrite("# emptied by mistake\n", 3_000)
    clock.now += 1.0
    assert keys.check("Bearer new-key") is None  # the keys in force stay
    path.unlink()
    clock.now += 1.0
    assert keys.check("Bearer new-key") is None


# --- TLS options ---------------------------------------------------------------------------

def test_tls_is_off_by_default_and_the_options_are_checked(certs: CertPaths) -> None:
    assert not ServerConfig().tls
    assert ChannelSecurity.from_options(ServerConfig()) is None
    with pytest.raises(ValueError, match="tls_key='': expected set together with --tls-cert"):
        TlsOptions(tls_cert=str(certs.server_cert))
    with pytest.raises(ValueError, match="tls_cert='': expected a certificate"):
        TlsOptions(tls_ca=str(certs.ca))
    with pytest.raises(ValueError, match="tls_cert='/nope.pem': expected a readable PEM file"):
        TlsOptions(tls_cert="/nope.pem", tls_key=str(certs.server_key))


def test_channel_security_presents_the_certificate_only_in_mutual_tls(certs: CertPaths) -> None:
    server_only = TlsOptions(tls_cert=str(certs.server_cert), tls_key=str(certs.server_key))
    mutual = TlsOptions(tls_cert=str(certs.server_cert), tls_key=str(certs.server_key),
                        tls_ca=str(certs.ca), tls_server_name="pdserve.internal")
    assert ChannelSecurity.from_options(server_only) == ChannelSecurity()
    sec = ChannelSecurity.from_options(mutual)
    assert sec == ChannelSecurity(str(certs.ca), str(certs.server_cert), str(certs.server_key),
                                  "pdserve.internal")
    assert sec.options() == (("grpc.ssl_target_name_override", "pdserve.internal"),)
    ctx = sec.ssl_client_context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


# --- certificates --------------------------------------------------------------------------

def test_certs_create_writes_a_ca_and_certificates_that_chain_to_it(certs: CertPaths) -> None:
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    server = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())
    client = x509.load_pem_x509_certificate(certs.client_cert.read_bytes())
    ca_key = ca.public_key()
    assert isinstance(ca_key, ec.EllipticCurvePublicKey)
    for cert in (server, client):
        assert cert.issuer == ca.subject
        assert cert.signature_hash_algorithm is not None
        ca_key.verify(cert.signature, cert.tbs_certificate_bytes,
                      ec.ECDSA(cert.signature_hash_algorithm))
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", "pdserve.internal"}
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1", "::1", "10.1.2.3"}
    usages = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert certs.server_key.stat().st_mode & 0o077 == 0  # keys are private to their owner


# --- write grants --------------------------------------------------------------------------

KEY = TicketKey("req-1", 7)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_grant_admits_only_its_ticket_from_the_address_it_was_issued_for() -> None:
    grants = GrantBook(ttl_s=60.0)
    token = grants.issue(KEY, "pdserve", b"ucx-A")
    grants.check(KEY, token, b"ucx-A")
    with pytest.raises(Unauthorized, match="carries no grant"):
        grants.check(KEY, b"", b"ucx-A")
    with pytest.raises(Unauthorized, match="the grant does not match"):
        grants.check(KEY, bytes(16), b"ucx-A")
    with pytest.raises(Unauthorized, match="another UCX worker"):
        grants.check(KEY, token, b"ucx-B")
    with pytest.raises(Unauthorized, match="no grant was issued"):
        grants.check(TicketKey("req-1", 8), token, b"ucx-A")


def test_a_ticket_stays_bound_to_the_first_peer_it_was_granted_to() -> None:
    grants = GrantBook(ttl_s=60.0)
    token = grants.issue(KEY, "agent-a", b"ucx-A")
    assert grants.issue(KEY, "agent-a", b"ucx-A") == token  # a retry gets the same grant
    with pytest.raises(Unauthorized, match=r"already granted to another peer \(agent-a\)"):
        grants.issue(KEY, "agent-b", b"ucx-B")
    with pytest.raises(Unauthorized, match="already granted"):
        grants.issue(KEY, "agent-a", b"ucx-B")
    with pytest.raises(Unauthorized, match="needs an authenticated peer"):
        grants.issue(TicketKey("req-2", 1), "", b"")


def test_grants_end_with_their_ticket_or_their_lifetime() -> None:
    clock = Clock()
    grants = GrantBook(ttl_s=10.0, clock=clock)
    token = grants.issue(KEY, "agent-a", b"")
    grants.drop(KEY)
    with pytest.raises(Unauthorized, match="no grant was issued"):
        grants.check(KEY, token, b"")
    token = grants.issue(KEY, "agent-b", b"")  # dropped: free to grant again
    clock.now += 10.0
    with pytest.raises(Unauthorized, match="no grant was issued"):
        grants.check(KEY, token, b"")
    grants.sweep()
    assert len(grants) == 0


def test_the_grant_travels_in_the_write_header_and_old_headers_still_parse() -> None:
    fp = LayoutFingerprint("m", "r", "float32", 2, 2, 16, 4, 0, 1)
    header = WriteHeader(1, KEY, 5, "decode-0/1", fp, 1024, ((3, 2),), 1000.0, b"ucx-A",
                         grant=b"\x00\x01secret")
    assert WriteHeader.decode(header.encode()) == header
    plain = WriteHeader(1, KEY, 5, "decode-0/1", fp, 1024, ((3, 2),), 1000.0)
    assert b"grant" not in plain.encode()
    assert WriteHeader.decode(plain.encode()).grant == b""


# --- pdserve up --tls ----------------------------------------------------------------------

def test_up_makes_missing_certificates_and_hands_them_to_every_process(tmp_path: Path) -> None:
    from pdserve.up import UpConfig, plan, prepare_certs

    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    directory = tmp_path / "tls"
    cfg = UpConfig(tls=str(directory), api_key_file=str(keys), prefill=2)
    security = prepare_certs(cfg)
    paths = CertPaths(directory)
    assert paths.complete()
    assert security == ChannelSecurity(str(paths.ca), str(paths.server_cert),
                                       str(paths.server_key))
    ca = paths.ca.read_bytes()
    prepare_certs(cfg)  # present: kept, not replaced
    assert paths.ca.read_bytes() == ca
    procs = plan(cfg, tmp_path, "builtin-tiny")
    assert [p.name for p in procs] == ["kvtransfer-a", "kvtransfer-b", "decode-0", "prefill-0",
                                       "prefill-1", "router"]
    for p in procs:
        flags = dict(zip(p.argv, p.argv[1:]))
        assert (flags["--tls-cert"], flags["--tls-key"], flags["--tls-ca"]) == (
            str(paths.server_cert), str(paths.server_key), str(paths.ca)), p.name
        assert ("--api-key-file" in flags) == (p.name == "router"), p.name
    assert prepare_certs(UpConfig()) is None
    assert not any("--tls-cert" in p.argv for p in plan(UpConfig(), tmp_path, "builtin-tiny"))
