"""`projections/edge.py` `not_json`: which action requests the edge refuses with 415 before reading
their body (an action's body must be declared JSON; curl's `-d` alone declares a form)."""

from __future__ import annotations

import json

import pytest

from projections.edge import not_json


def scope(**headers: str) -> dict:
    return {"type": "http", "method": "POST", "path": "/api/webhooks",
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                          "application/merge-patch+json"])
def test_a_json_body_passes(content_type):
    assert not_json(scope(content_length="12", content_type=content_type)) is None


def test_no_body_needs_no_content_type():
    assert not_json(scope()) is None
    assert not_json(scope(content_length="0")) is None
    assert not_json(scope(content_length="0", content_type="application/x-www-form-urlencoded")) is None


@pytest.mark.parametrize("headers", [
    {"content_length": "30", "content_type": "application/x-www-form-urlencoded"},
    {"content_length": "30", "content_type": "text/plain"},
    {"content_length": "30"},
    {"transfer_encoding": "chunked", "content_type": "multipart/form-data; boundary=x"},
    {"content_length": "30", "content_type": "application/jsonx"},
])
def test_a_body_not_declared_json_is_415_naming_the_header_and_the_fix(headers):
    status, body, answer_headers = not_json(scope(**headers))
    detail = json.loads(body)["detail"]
    assert status == 415 and (b"content-type", b"application/json") in answer_headers
    assert "Content-Type: application/json" in detail and "curl" in detail
    assert (headers.get("content_type", "none").split(";")[0].lower()) in detail


UNHOLDABLE = [b'{"operator": "\\ud800", "why": "x"}', b'{"operator": "a", "why": "x\\udfff"}', b'{"\\udc00": 1}',
              b'{"a": ["ok", {"b": "\\ud83d"}]}', b'{"why": 1e999}', b'{"why": -1e999}', b'{"why": NaN}',
              b'{"why": Infinity}', b'[-Infinity]', b'"\\ud800"']
"""JSON Python's parser accepts that no field of ours can hold: lone surrogates (UTF-8 cannot carry
one: the 422 renderer failed on it with a 500, issue 44 item 6) and non-finite numbers (1e999
parses as inf; the renderer's JSON has no inf)."""


@pytest.mark.parametrize("body", UNHOLDABLE)
def test_a_json_body_with_a_lone_surrogate_or_a_non_finite_number_is_400(body):
    from projections.edge import unholdable_json
    status, answer, _ = unholdable_json(scope(content_length=str(len(body)), content_type="application/json"), body)
    assert status == 400 and "JSON" in json.loads(answer)["detail"]


@pytest.mark.parametrize("body", [b'{"operator": "\\ud83d\\ude00 ok", "why": "caf\\u00e9"}', b'{"n": 1e308, "m": -2}',
                                  b'{"broken": ', b'', b'[' * 5000 + b']' * 5000, "{\"x\": \"\u00e9\"}".encode()])
def test_other_bodies_are_left_to_the_route(body):
    """A pair of surrogates is one character; malformed JSON is the route's 422 (FastAPI's own)."""
    from projections.edge import unholdable_json
    assert unholdable_json(scope(content_length=str(len(body)), content_type="application/json"), body) is None


def test_a_body_not_declared_json_is_not_read_as_json():
    from projections.edge import unholdable_json
    assert unholdable_json(scope(content_length="20", content_type="application/x-www-form-urlencoded"),
                           b"why=%ED%A0%80") is None
