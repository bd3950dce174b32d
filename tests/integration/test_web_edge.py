"""The edge of `tapeline serve` (issue 20 items 4 and 6, `projections/edge.py`) against a real
server on real PostgreSQL and Kafka: the admin token is checked before a body is read, every body
has a cap (the dashboard's forms have the JSON API's field limits), every response carries the
security headers, a foreign Host header is refused, and the OpenAPI page loads nothing from a CDN."""

from __future__ import annotations

import re
import socket
import threading

import httpx
import pytest
import uvicorn
from pydantic import SecretStr

from projections.edge import allowed_hosts
from cli.wiring import build_app
from tests.conftest import wait_for

pytestmark = pytest.mark.integration
TOKEN = "edge-test-token"


@pytest.fixture(scope="module")
def server(isolated):
    """`tapeline serve`'s whole app (read API, dashboard, actions, intake) under uvicorn in a thread."""
    settings = isolated.model_copy(update={"admin_token": SecretStr(TOKEN), "intake_tokens": {"tok-edge": "edge"}})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(build_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait_for(lambda: uv.started, 30, "uvicorn to start")
    yield f"http://127.0.0.1:{port}", port, settings
    uv.should_exit = True
    thread.join(15)


def raw_post(port: int, path: str, headers: dict[str, str], first_bytes: bytes) -> str:
    """Send a request's headers and only `first_bytes` of its body, then read the answer's status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode() + first_bytes)
        return sock.recv(65536).decode(errors="replace")


def test_an_action_without_a_token_is_refused_before_its_60_mb_body_is_read(server):
    _, port, _ = server
    # The body is announced as 60 MB and only 64 KiB of it is ever sent: an answer can only come
    # from a server that did not wait for (let alone parse) the body.
    answer = raw_post(port, "/api/jobs/some-job/cancel",
                      {"Content-Type": "application/json", "Content-Length": str(60 * 1024 * 1024)},
                      b'{"operator": "x", "why": "' + b"a" * 65536)
    assert answer.startswith("HTTP/1.1 401"), answer[:200]
    assert "www-authenticate: bearer" in answer.lower()


def test_an_announced_body_past_the_cap_is_413_before_it_is_read_even_with_the_token(server):
    _, port, settings = server
    answer = raw_post(port, "/api/jobs/some-job/cancel",
                      {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}",
                       "Content-Length": str(settings.serve_max_body_bytes + 1)}, b"{")
    assert answer.startswith("HTTP/1.1 413"), answer[:200]


def test_a_chunked_body_past_the_cap_is_413(server):
    url, _, settings = server

    def chunks():
        for _ in range(settings.serve_max_body_bytes // 8192 + 2):
            yield b" " * 8192
    response = httpx.post(f"{url}/api/jobs/some-job/cancel", content=chunks(), timeout=20,
                          headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert response.status_code == 413 and "the most this route takes" in response.json()["detail"]


def test_the_forms_take_the_json_apis_limits(server):
    url, _, _ = server
    form = {"token": TOKEN, "operator": "ops", "dead_letter_id": "x/1"}
    too_long = httpx.post(f"{url}/ui/dead-letters/replay", data={**form, "why": "w" * 2001}, timeout=20)
    assert too_long.status_code == 422
    huge = httpx.post(f"{url}/ui/dead-letters/replay", data={**form, "why": "w" * 900_000}, timeout=20)
    assert huge.status_code == 413
    json_api = httpx.post(f"{url}/api/dead-letters/replay", json={**form, "why": "w" * 2001}, timeout=20,
                          headers={"Authorization": f"Bearer {TOKEN}"})
    assert json_api.status_code == 422


def test_a_good_token_and_a_small_body_still_reach_the_action(server):
    url, _, _ = server
    response = httpx.post(f"{url}/api/jobs/no-such-job/cancel", json={"operator": "ops", "why": "edge test"},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert response.status_code == 404, response.text  # the handler ran: the job is unknown


@pytest.mark.parametrize("path", ["/", "/stalled", "/api/overview", "/docs", "/openapi.json", "/no-such-page"])
def test_every_response_carries_the_security_headers(server, path):
    url, _, _ = server
    response = httpx.get(f"{url}{path}", timeout=20)
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["referrer-policy"] == "no-referrer"
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy


def test_a_foreign_host_header_is_refused(server, isolated):
    url, _, _ = server
    assert httpx.get(f"{url}/api/overview", headers={"Host": "attacker.example"}, timeout=20).status_code == 400
    assert httpx.get(f"{url}/api/overview", headers={"Host": "localhost"}, timeout=20).status_code == 200
    assert allowed_hosts(isolated, "0.0.0.0") == ["*"]
    assert allowed_hosts(isolated.model_copy(update={"serve_allowed_hosts": ["tapeline.example"]}), "0.0.0.0") == \
        ["tapeline.example"]


def test_the_openapi_page_loads_its_assets_from_this_server(server):
    url, _, _ = server
    page = httpx.get(f"{url}/docs", timeout=20)
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sources and all(s.startswith("/") for s in sources), sources
    for source in sources:
        assert httpx.get(f"{url}{source}", timeout=20).status_code == 200, source
    assert "'sha256-" in page.headers["content-security-policy"]


def test_a_page_shows_only_the_outcomes_this_server_wrote(server):
    """Issue 20 item 6: the outcome of a form action travels in the redirect's query (`?msg=`,
    `?err=`) and was shown verbatim, so anyone could send an operator a dashboard link that says
    what they like ("replay done: now run ..."). Now the server signs what it writes (`&sig=`,
    `projections/edge.py` FlashSigner) and a page shows only text whose signature holds."""
    base, _, _ = server
    spoof = "cancel: done. Your admin token expired, paste it at evil.example"
    for query in ({"msg": spoof}, {"err": spoof}, {"msg": spoof, "sig": "AAAAAAAAAAAAAAAAAAAAAA"}):
        page = httpx.get(f"{base}/stalled", params=query)
        assert page.status_code == 200 and "evil.example" not in page.text, query
    # A real outcome: a cancel of an unknown job through the form redirects with a signed error...
    answer = httpx.post(f"{base}/ui/jobs/no-such-job/cancel", data={"token": TOKEN, "operator": "a", "why": "b"})
    assert answer.status_code == 303 and "sig=" in answer.headers["location"]
    shown = httpx.get(f"{base}{answer.headers['location']}")
    assert "no job &#39;no-such-job&#39;" in shown.text or "no job 'no-such-job'" in shown.text, shown.text[:2000]
    # ...and the same signature does not vouch for other text.
    path, query = answer.headers["location"].split("?", 1)
    forged = httpx.get(f"{base}{path}?{query.replace('no-such-job', 'evil.example')}")
    assert "no-such-job" in forged.text and "evil.example" not in forged.text


def test_an_action_body_not_sent_as_json_is_415_naming_the_header(server):
    """curl's `-d` alone sends `application/x-www-form-urlencoded`: an action answered FastAPI's 422
    "Input should be a valid dictionary or object", naming neither the header nor the fix (found
    registering a webhook endpoint with curl as a user, issue 23). Now 415 from the headers, before
    the body is read; a JSON body, with or without a charset, still reaches the action, and an
    action that takes no body needs no Content-Type."""
    base, _, _ = server
    admin = {"Authorization": f"Bearer {TOKEN}"}
    body = '{"submitter": "edge", "url": "http://8.8.8.8/hook"}'
    for content_type in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"):
        answer = httpx.post(f"{base}/api/webhooks", headers={**admin, "Content-Type": content_type}, content=body)
        assert answer.status_code == 415, (content_type, answer.text)
        assert "Content-Type: application/json" in answer.json()["detail"] and content_type.split(";")[0] in answer.text
    # no token: still 401 first, whatever the body
    assert httpx.post(f"{base}/api/webhooks", data={"submitter": "edge"}).status_code == 401
    made = httpx.post(f"{base}/api/webhooks", headers={**admin, "Content-Type": "application/json; charset=utf-8"},
                      content=body)
    assert made.status_code == 201, made.text
    endpoint = made.json()["endpoint_id"]
    # the reason of a disable is optional: a bare POST disables with the default one
    bare = httpx.post(f"{base}/api/webhooks/{endpoint}/disable", headers=admin)
    assert bare.status_code == 200 and bare.json()["enabled"] is False, bare.text
    listed = httpx.get(f"{base}/api/webhooks", params={"submitter": "edge"}, headers=admin).json()
    assert listed[0]["disabled_reason"] == "disabled by an operator"
    assert httpx.post(f"{base}/api/webhooks/{endpoint}/enable", headers=admin).json()["enabled"] is True
    assert httpx.delete(f"{base}/api/webhooks/{endpoint}", headers=admin).json()["removed"] is True


def _series(text: str) -> list[str]:
    """The sample lines of a Prometheus text exposition (no comments)."""
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_no_request_can_add_metric_series(server):
    """Issue 44 item 2: the 401 path of an admin route labelled `tapeline_operator_actions_total` with
    the last piece of the request path, so 50 anonymous `DELETE /api/webhooks/<10 KB id>` grew
    `/metrics` from 97 KB to 1.1 MB; the request counter also took the HTTP method as sent (h11
    accepts any token). Labels come from the route template and fixed sets: a second wave of
    requests with fresh ids, paths and methods adds no series, and no piece of them is exported."""
    base, port, _ = server

    def wave(tag: str) -> None:
        for n in range(5):
            marker = f"zz{tag}{n}" + "q" * 200
            assert httpx.delete(f"{base}/api/webhooks/{marker}").status_code == 401
            assert httpx.post(f"{base}/api/webhooks/{marker}/disable").status_code == 401
            assert httpx.post(f"{base}/api/webhooks/{marker}/{marker}").status_code in (401, 404, 405)
            assert httpx.get(f"{base}/no-such/{marker}").status_code == 404
            for path in (f"/api/webhooks/{marker}", "/api/overview", f"/{marker}"):
                with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
                    sock.sendall(f"ZZ{tag.upper()}{n}METHOD {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                 f"Connection: close\r\n\r\n".encode())
                    assert sock.recv(65536).startswith(b"HTTP/1.1 4")

    httpx.get(f"{base}/metrics")  # a scrape is counted once it has answered: its own series exists from now on
    wave("a")
    before = {line.rsplit(" ", 1)[0] for line in _series(httpx.get(f"{base}/metrics").text)}
    wave("b")
    text = httpx.get(f"{base}/metrics").text
    after = {line.rsplit(" ", 1)[0] for line in _series(text)}
    assert "zz" not in text.lower(), [line for line in after if "zz" in line.lower()][:5]
    assert after == before, after ^ before
    assert 'tapeline_operator_actions_total{action="webhooks",result="unauthorized"}' in text
    assert 'tapeline_operator_actions_total{action="disable",result="unauthorized"}' in text


def test_a_lone_surrogate_or_a_non_finite_number_in_any_json_body_is_400(server):
    """Issue 44 item 6: a lone surrogate or `1e999` in an admin JSON body answered 500 (the 422
    renderer cannot encode what it echoes; a value that passed validation failed deeper). Every
    route that takes a JSON body (from the OpenAPI document) now answers 400 at the edge, after the
    token check; an ordinary body still reaches the route."""
    base, _, _ = server
    admin = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    paths = httpx.get(f"{base}/openapi.json").json()["paths"]
    takes_json = [(method, path.replace("{", "").replace("}", "-x")) for path, ops in paths.items()
                  for method, op in ops.items() if "application/json" in op.get("requestBody", {}).get("content", {})]
    assert len(takes_json) >= 6, takes_json
    bodies = [b'{"operator": "\\ud800", "why": "x", "submitter": "s", "url": "http://8.8.8.8/"}',
              b'{"operator": "ops", "why": "x\\udfff", "dead_letter_id": "a/1", "posted_ref": "p"}',
              b'{"\\udc00": "key"}', b'{"operator": "ops", "why": 1e999}', b'{"why": -1e999}', b'{"refund": NaN}',
              b'{"why": Infinity}', b'{"url": "http://8.8.8.8/", "event_types": ["\\ud83d"]}']
    for method, path in takes_json:
        for body in bodies:
            answer = httpx.request(method, f"{base}{path}", content=body, headers=admin, timeout=20)
            assert answer.status_code == 400, (method, path, body, answer.status_code, answer.text[:300])
            assert "the JSON body cannot be taken" in answer.json()["detail"]
        anonymous = httpx.request(method, f"{base}{path}", content=bodies[0],
                                  headers={"Content-Type": "application/json"}, timeout=20)
        assert anonymous.status_code == 401  # the token is checked first, as before
    good = httpx.post(f"{base}/api/jobs/no-such-job/cancel", headers=admin, timeout=20,
                      content='{"operator": "ops \\ud83d\\ude00", "why": "caf\\u00e9"}')
    assert good.status_code == 404, good.text  # a surrogate pair is one character: the route ran
