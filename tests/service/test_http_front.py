"""The HTTP front door on a real port (uvicorn, in this process) in front of the router's
lifecycle and scripted fake workers on loopback gRPC: the errors a real stack rarely shows
(no room, draining, a worker dying mid-stream), API keys, HTTPS, a busy port."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from pdserve.certs import CertPaths, create
from pdserve.common.config import TlsOptions
from pdserve.common.security import ApiKeys
from pdserve.common.server import ServerStartError
from pdserve.router.http_app import HttpApi
from pdserve.router.http_server import HttpServer

from tests.support import wait_for

pytestmark = pytest.mark.service

KEY = "sk-test-0123456789"


@pytest.fixture
def front(stack, tmp_path):
    """(script, start(keys, tls) -> base URL of a new HTTP server on a free port, lifecycle,
    the servers started)."""
    script, _stub, lifecycle = stack
    executor = ThreadPoolExecutor(8)
    servers: list[HttpServer] = []

    def start(keys: ApiKeys | None = None, tls: TlsOptions | None = None) -> str:
        app = HttpApi(lifecycle, executor, ready=lambda: True, api_keys=keys).app()
        server = HttpServer.start(app, "127.0.0.1", 0, tls=tls, grace_s=30)
        servers.append(server)
        return f"{server.scheme}://127.0.0.1:{server.port}"

    yield script, start, lifecycle, servers
    for server in servers:
        server.stop(5)
    executor.shutdown(wait=False)


def call(url: str, body: dict | None = None, headers: dict | None = None,
         context: ssl.SSLContext | None = None) -> tuple[int, dict, str]:
    """(status, headers, body text) of one request."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as reply:
            return reply.status, _lower(reply.headers), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, _lower(exc.headers), exc.read().decode()


def _lower(headers) -> dict:
    return {k.lower(): v for k, v in headers.items()}


def test_no_room_is_429_and_draining_is_503_both_with_retry_after(front):
    script, start, lifecycle, _ = front
    url = start()
    script.exhausted = True
    status, headers, body = call(f"{url}/v1/completions", {"prompt": "hello"})
    assert (status, headers.get("retry-after")) == (429, "1")
    assert json.loads(body)["error"]["code"] == "resource_exhausted"
    assert "no decode worker has room" in json.loads(body)["error"]["message"]
    script.exhausted = False
    assert call(f"{url}/health")[0] == 200
    lifecycle.stop_admitting()
    status, headers, body = call(f"{url}/v1/completions", {"prompt": "hello"})
    assert (status, headers.get("retry-after")) == (503, "1") and "draining" in body
    assert call(f"{url}/health")[:1] == (503,) and "draining" in call(f"{url}/health")[2]


def test_a_worker_dying_mid_stream_ends_the_stream_with_an_error_event(front):
    script, start, _, _ = front
    url = start()
    script.decode_fail_after = 2
    status, _, body = call(f"{url}/v1/completions", {"prompt": "hello", "stream": True,
                                                     "max_tokens": 10})
    events = [json.loads(e.removeprefix("data: ")) for e in body.split("\n\n") if e]
    assert status == 200 and [e["choices"][0]["text"] != "" for e in events[:1]] == [True]
    assert events[-1]["error"]["code"] == "unavailable" and "died" in events[-1]["error"][
        "message"]
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.APIError, match="died"):
            list(client.completions.create(model="tiny-test", prompt="hello", stream=True))


def test_api_keys_guard_everything_but_health_and_metrics(front, tmp_path):
    _, start, _, _ = front
    keys = tmp_path / "keys"
    keys.write_text(f"# one key\n{KEY}\n")
    url = start(keys=ApiKeys.from_file(str(keys)))
    for headers, why in (({}, "missing API key"),
                         ({"Authorization": "Bearer nope"}, "invalid API key"),
                         ({"Authorization": KEY}, "malformed authorization header")):
        status, got, body = call(f"{url}/v1/completions", {"prompt": "hi"}, headers)
        assert (status, got.get("www-authenticate")) == (401, "Bearer"), body
        error = json.loads(body)["error"]
        assert why in error["message"] and error["type"] == "authentication_error"
        assert call(f"{url}/v1/models", headers=headers)[0] == 401
    assert call(f"{url}/health")[0] == 200 and call(f"{url}/metrics")[0] == 200
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as client:
        assert client.models.list().data[0].id == "tiny-test"
        assert client.completions.create(model="tiny-test", prompt="hi", max_tokens=3).usage
    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            client.completions.create(model="tiny-test", prompt="hi")


def test_https_with_the_services_certificate(front, tmp_path):
    _, start, _, _ = front
    certs: CertPaths = create(tmp_path / "certs")
    url = start(tls=TlsOptions(tls_cert=str(certs.server_cert), tls_key=str(certs.server_key)))
    assert url.startswith("https://")
    trusted = ssl.create_default_context(cafile=str(certs.ca))
    status, _, body = call(f"{url}/v1/completions", {"prompt": "hello", "max_tokens": 2},
                           context=trusted)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        call(f"{url}/health", context=ssl.create_default_context())


def test_a_busy_port_fails_the_start_naming_the_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"port {port} is in use.*--http-port"):
            HttpServer.start(HttpApi.__new__(HttpApi), "127.0.0.1", port)


def test_unknown_routes_and_methods_answer_in_openai_shape(front):
    _, start, _, _ = front
    url = start()
    status, _, body = call(f"{url}/v2/whatever")
    assert status == 404 and "no route /v2/whatever" in json.loads(body)["error"]["message"]
    status, _, body = call(f"{url}/v1/completions")  # GET
    assert status == 405 and "method GET is not allowed" in json.loads(body)["error"]["message"]
    assert json.loads(body)["error"]["type"] == "invalid_request_error"  # the client's mistake
    status, _, body = call(f"{url}/v1/models/other")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def test_draining_lets_streams_in_flight_finish_and_takes_no_new_connection(front):
    script, start, lifecycle, _ = front
    script.tokens = script.tokens * 9  # about 230 tokens, 5 ms apart (the context is 256)
    url = start()
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "prompt": "hello", "stream": True, "max_tokens": len(script.tokens),
        "return_token_ids": True}))
    reply = conn.getresponse()
    assert reply.readline().startswith(b"data: {")
    lifecycle.stop_admitting()  # what SIGTERM does: the gRPC bootstrap's on_drain
    _server_of(front, port).drain()
    assert wait_for(lambda: not _accepts(port), timeout_s=10)  # no new connection...
    rest = reply.read()  # ...while the stream in flight goes on to its end
    conn.close()
    assert rest.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in rest
    chunks = [json.loads(e[6:]) for e in rest.split(b"\n\n") if e.startswith(b"data: {")]
    after = sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"])
    assert after > len(script.tokens) // 4, "the stream had ended before the drain began"


def _server_of(front, port: int) -> HttpServer:
    return next(s for s in front[3] if s.port == port)


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
