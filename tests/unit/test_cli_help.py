"""What `--help` tells an operator: the accepted values of every flag with a fixed set, the
defaults of `pdserve generate`, and the built-in models as the one registry lists them."""

from __future__ import annotations

import grpc
import pytest
from pdserve import cli, client
from pdserve.common.config import LOG_LEVELS, build_parser, parse_config
from pdserve.common.models import BUILTIN_MODELS
from pdserve.decode.main import DecodeConfig
from pdserve.kvtransfer.config import AgentConfig
from pdserve.plan.measure import ProfileConfig
from pdserve.router.config import RouterConfig
from pdserve.worker.config import DTYPES

pytestmark = pytest.mark.unit


def _help(cls: type, service: str) -> str:
    """The options part of `--help`, on one line."""
    text = " ".join(build_parser(cls, service, env={}).format_help().split())
    return text[text.index("options:"):]


@pytest.mark.parametrize("cls, service, flag, values", [
    (DecodeConfig, "decode", "--log-level", LOG_LEVELS),
    (DecodeConfig, "decode", "--log-format", ("text", "json")),
    (DecodeConfig, "decode", "--dtype", DTYPES),
    (ProfileConfig, "profile", "--dtype", DTYPES),
    (AgentConfig, "kvtransfer", "--transport", ("ucx", "tcp")),
    (RouterConfig, "router", "--log-level", LOG_LEVELS),
])
def test_help_lists_the_accepted_values(cls, service, flag, values):
    assert f"{flag} {{{','.join(values)}}}" in _help(cls, service)


@pytest.mark.parametrize("argv, field, value", [
    (["--log-level", "debug"], "log_level", "DEBUG"),
    (["--log-level", "Warning"], "log_level", "WARNING"),
    (["--log-format", "JSON"], "log_format", "json"),
    (["--dtype", "BFloat16"], "dtype", "bfloat16"),
])
def test_choices_are_case_insensitive(argv, field, value):
    assert getattr(parse_config(DecodeConfig, "decode", argv, env={}), field) == value


def test_an_env_twin_is_case_insensitive_too():
    cfg = parse_config(DecodeConfig, "decode", [], env={"PDSERVE_DECODE_LOG_LEVEL": "debug"})
    assert cfg.log_level == "DEBUG"


def test_an_unknown_choice_is_refused_with_the_list(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(DecodeConfig, "decode", ["--log-level", "verbose"], env={})
    assert exit_info.value.code == 2
    assert "invalid choice: 'verbose'" in capsys.readouterr().err


@pytest.mark.parametrize("cls, service", [(DecodeConfig, "decode"), (RouterConfig, "router"),
                                          (ProfileConfig, "profile")])
def test_model_help_lists_every_builtin_model(cls, service):
    text = _help(cls, service)
    start = text.index("--model MODEL")
    model_help = text[start:text.index("PDSERVE_", start)]
    assert all(name in model_help for name in BUILTIN_MODELS), model_help


def test_router_model_default_is_stated_once():
    text = _help(RouterConfig, "router")
    model_help = text[text.index("--model MODEL"):text.index("--model-name")]
    assert "default: smollm2]" in model_help and "(none)" not in model_help
    assert parse_config(RouterConfig, "router", ["--prefill", "p:1", "--decode", "d:1"],
                        env={}).model == "smollm2"


def test_generate_help_states_every_default(capsys):
    with pytest.raises(SystemExit):
        client.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    text = text[text.index("options:"):]
    for flag, default in [("--max-tokens", "server default 128"),
                          ("--top-p", "server default 1.0"), ("--top-k", "server default 0"),
                          ("--seed", "server default: none"), ("--ignore-eos", "default: stop"),
                          ("--request-id", "default: one the router makes up")]:
        after = text[text.index(f"{flag} "):]
        assert default in after[:200], (flag, after[:200])


def test_pdserve_help_lists_every_model_command(capsys):
    assert cli.main(["--help"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.strip().startswith("model "))
    assert "model create" in line and "model ensure" in line
    assert "|".join(BUILTIN_MODELS) in line


@pytest.mark.parametrize("value", ["-1", "0", "nan", "soon"])
def test_generate_refuses_a_timeout_that_is_not_positive(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        client.main(["--timeout", value, "hi"])
    assert exit_info.value.code == 2
    assert f"argument --timeout: '{value}'" in capsys.readouterr().err


REFUSED = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed "
           "to connect to remote host: Connection refused")
CLOSED = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:9: "
          "Socket closed")


@pytest.mark.parametrize("code, details, tls, hint", [
    (grpc.StatusCode.UNAVAILABLE, CLOSED, False, "try --tls / --tls-ca"),
    (grpc.StatusCode.UNAVAILABLE, CLOSED, True, ""),  # already TLS: the details say the rest
    (grpc.StatusCode.UNAVAILABLE, REFUSED, False, "is a router running at --address?"),
    (grpc.StatusCode.UNAVAILABLE, "no decode worker is ready", False, ""),  # the router's own
    (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens=0: must be > 0", False, ""),
])
def test_generate_hints_at_why_it_could_not_connect(code, details, tls, hint):
    got = client.connect_hint(code, details, tls=tls)
    assert (hint in got) if hint else got == ""
