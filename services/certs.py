"""`pdserve certs create DIR`: a throwaway CA and certificates for a TLS / mutual-TLS stack.

Writes, with the `cryptography` package (no openssl binary needed):

    ca.pem                     the CA certificate: every service's --tls-ca, a client's CA
    ca-key.pem                 the CA's key (keep it away from the services)
    server.pem, server-key.pem every service's --tls-cert / --tls-key (server and client use:
                               services present it to each other in mutual TLS)
    client.pem, client-key.pem a client certificate (for tools calling workers or agents)

The server certificate names localhost, 127.0.0.1, ::1 and every `--host` given (DNS names or
IP addresses). For tests and local stacks; production certificates come from your own CA.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
FILES = ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")


@dataclass(frozen=True)
class CertPaths:
    """The files of a directory made by `create`."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.directory / "server-key.pem"

    @property
    def client_cert(self) -> Path:
        return self.directory / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.directory / "client-key.pem"

    def complete(self) -> bool:
        return all((self.directory / name).is_file() for name in FILES)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _issue(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str,
           hosts: Sequence[str], usages: list[x509.ObjectIdentifier], days: int
           ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.SubjectAlternativeName(
                   [_san(h) for h in dict.fromkeys(hosts)] or [x509.DNSName(common_name)]),
                   critical=False))
    return builder.sign(ca_key, hashes.SHA256()), key


def create(directory: Path, hosts: Sequence[str] = (), days: int = 30) -> CertPaths:
    """Write a fresh CA, a server certificate for `DEFAULT_HOSTS + hosts` and a client
    certificate into `directory` (created if missing; files there are replaced)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_cert = (x509.CertificateBuilder().subject_name(_name("pdserve test CA"))
               .issuer_name(_name("pdserve test CA")).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False,
                                            decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    server, server_key = _issue(ca_cert, ca_key, "pdserve", [*DEFAULT_HOSTS, *hosts],
                                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                                days)
    client, client_key = _issue(ca_cert, ca_key, "pdserve-client", ["pdserve-client"],
                                [ExtendedKeyUsageOID.CLIENT_AUTH], days)
    paths = CertPaths(directory)
    pem = serialization.Encoding.PEM
    _write(paths.ca, ca_cert.public_bytes(pem))
    _write(directory / "ca-key.pem", _key_pem(ca_key), private=True)
    _write(paths.server_cert, server.public_bytes(pem))
    _write(paths.server_key, _key_pem(server_key), private=True)
    _write(paths.client_cert, client.public_bytes(pem))
    _write(paths.client_key, _key_pem(client_key), private=True)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve certs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("create", help="write a throwaway CA and certificates into DIR")
    make.add_argument("directory", metavar="DIR")
    make.add_argument("--host", action="append", default=[],
                      help="another DNS name or IP address for the server certificate "
                           "(repeatable; localhost, 127.0.0.1 and ::1 are always in)")
    make.add_argument("--days", type=int, default=30, help="validity in days (default 30)")
    args = parser.parse_args(argv)
    if args.days <= 0:
        parser.error(f"--days={args.days}: expected > 0")
    paths = create(Path(args.directory), args.host, args.days)
    print(f"wrote {', '.join(FILES)} to {paths.directory}")
    print(f"  pdserve up --tls {paths.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
