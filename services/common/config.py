"""The one typed-config pattern: a frozen dataclass per service, built from flags and env.

Declare each setting once, as a dataclass field with `option(default, help)`:

    @dataclass(frozen=True)
    class DecodeConfig(ServerConfig):
        port: int = option(50071, "gRPC port")
        num_pages: int = option(1024, "KV pages in the pool")

        def __post_init__(self) -> None:
            super().__post_init__()
            require(self.num_pages > 0, "num_pages", self.num_pages, "> 0")

    cfg = parse_config(DecodeConfig, "decode", argv)

Every field becomes a flag (`--num-pages`) with an environment twin (`PDSERVE_DECODE_NUM_PAGES`);
a set environment variable is the flag's default and is shown in `--help`. Field types: str,
int, float, bool (`--x/--no-x`), `tuple[str, ...]` (comma-separated) and `X | None`.
Validation lives in `__post_init__`; its `ValueError` names the field and the bad value and
becomes a usage error (exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "PDSERVE"
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
METRICS_PORT_HELP = "Prometheus /metrics HTTP port (0 = any free port, -1 = off)"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def option(default: Any, help: str, *, choices: Sequence[Any] | None = None) -> Any:
    """A config field: its default, its `--help` text and optionally the allowed values."""
    return field(default=default, metadata={"help": help, "choices": choices})


def env_name(service: str, name: str) -> str:
    """`env_name("router", "max_retries")` -> `PDSERVE_ROUTER_MAX_RETRIES`."""
    return f"{ENV_PREFIX}_{service}_{name}".upper().replace("-", "_")


def require(ok: bool, name: str, value: Any, expected: str) -> None:
    """Raise `ValueError("<name>=<value!r>: expected <expected>")` unless `ok`."""
    if not ok:
        raise ValueError(f"{name}={value!r}: expected {expected}")


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _converter(hint: Any) -> tuple[Callable[[str], Any], bool]:
    """The str -> value function for a field type, and whether None is allowed."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    if hint is bool:
        return _parse_bool, optional
    if typing.get_origin(hint) is tuple:
        return _parse_list, optional
    if hint in (int, float, str):
        return hint, optional
    raise TypeError(f"unsupported config field type {hint!r}")


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    """str -> the choice it names, whatever its case (`--log-level debug` is DEBUG); other
    text unchanged, for argparse to refuse with the list of choices."""
    by_lower = {choice.lower(): choice for choice in choices}

    def convert(text: str) -> str:
        return by_lower.get(text.strip().lower(), text)
    return convert


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "(none)"
    return "(none)" if value is None else str(value)


def build_parser(cls: type, service: str, *, env: Mapping[str, str] | None = None,
                 prog: str | None = None, description: str | None = None
                 ) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of the config dataclass `cls`.

    Exits with a usage error (status 2) when an environment twin holds an unparsable value.
    """
    env = os.environ if env is None else env
    # the description as written: its examples and paragraphs, not one reflowed block
    parser = argparse.ArgumentParser(prog=prog, description=description or cls.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        convert, optional = _converter(hints[f.name])
        var = env_name(service, f.name)
        default = f.default
        if var in env:
            try:
                default = convert(env[var])
            except ValueError as exc:
                parser.error(f"{var}={env[var]!r}: {exc}")
        help_text = f"{f.metadata.get('help', '')} [env {var}; default: {_show(default)}]"
        kwargs: dict[str, Any] = {"dest": f.name, "default": default,
                                  "help": help_text.replace("%", "%%")}
        if convert is _parse_bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.metadata.get("choices"):  # shown as {a,b,c} in the usage and in --help
            kwargs["choices"] = choices = tuple(f.metadata["choices"])
            kwargs["type"] = _one_of(choices) if convert is str else convert
        else:
            kwargs["type"] = convert
            kwargs["metavar"] = f.name.upper()
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)
    return parser


def parse_config(cls: type[T], service: str, argv: Sequence[str] | None = None, *,
                 env: Mapping[str, str] | None = None, prog: str | None = None,
                 description: str | None = None) -> T:
    """Build the frozen config `cls` from `argv` (default sys.argv[1:]) and the environment.

    A validation error (`ValueError` from `__post_init__`) exits with status 2 and its message.
    """
    parser = build_parser(cls, service, env=env, prog=prog, description=description)
    namespace = parser.parse_args(argv)
    try:
        return cls(**vars(namespace))
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


@dataclass(frozen=True)
class TlsOptions:
    """TLS settings every service has (see docs/security.md); all empty: plaintext, as before.

    `tls_cert` + `tls_key`: this service's certificate, served on its port and, when
    `tls_ca` is set, presented to the services it calls. `tls_ca`: the CA that peers'
    certificates must chain to; with it, connections to other services are verified against it
    and this service's port requires a client certificate (mutual TLS) unless
    `tls_client_auth` is off (the router's public port).
    """

    tls_cert: str = option("", "PEM certificate of this service (with --tls-key: TLS on its port)")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_ca: str = option("", "PEM CA bundle peers' certificates must chain to; set: mutual TLS "
                             "between services (clients present --tls-cert)")
    tls_server_name: str = option("", "name the other services' certificates must carry "
                                      "(default: the host of each address)")
    tls_client_auth: bool = option(True, "with --tls-ca, refuse callers without a client "
                                         "certificate from that CA (mutual TLS)")

    def __post_init__(self) -> None:
        require(bool(self.tls_cert) == bool(self.tls_key), "tls_key", self.tls_key,
                "set together with --tls-cert" if self.tls_cert else
                "empty unless --tls-cert is set")
        require(not self.tls_ca or bool(self.tls_cert), "tls_cert", self.tls_cert,
                "a certificate (--tls-ca turns on mutual TLS, which needs one)")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            require(not path or os.path.isfile(path), name, path, "a readable PEM file")

    @property
    def tls(self) -> bool:
        """TLS is on (this service serves and calls over TLS)."""
        return bool(self.tls_cert)


@dataclass(frozen=True)
class ServerConfig(TlsOptions):
    """Settings every gRPC service has; a service's config subclasses this (override `port`
    and `metrics_port`)."""

    host: str = option("0.0.0.0", "address to listen on")
    port: int = option(0, "gRPC port (0 = any free port)")
    metrics_port: int = option(-1, METRICS_PORT_HELP)
    grace_s: float = option(30.0, "on SIGTERM, how long in-flight work may take to finish (s)")
    log_format: str = option("text", "log line format", choices=LOG_FORMATS)
    log_level: str = option("INFO", "lowest level logged", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.port <= 65535, "port", self.port, "0..65535")
        require(-1 <= self.metrics_port <= 65535, "metrics_port", self.metrics_port,
                "0..65535, or -1 (off)")
        require(bool(self.host), "host", self.host, "a host name or address")
        require(self.grace_s >= 0, "grace_s", self.grace_s, ">= 0")
        require(self.log_format in LOG_FORMATS, "log_format", self.log_format,
                " or ".join(LOG_FORMATS))
        require(self.log_level.upper() in LOG_LEVELS, "log_level", self.log_level,
                ", ".join(LOG_LEVELS))
