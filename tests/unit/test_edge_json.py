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
