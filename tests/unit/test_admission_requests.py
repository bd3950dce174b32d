"""The HTTP intake's pure request checks (domain/policy/admission.py): parameters, Idempotency-Key reuse."""

from __future__ import annotations

import pytest

from domain.policy.admission import Refusal, body_reuse, check_request, key_reuse
from tapeline.settings import Settings

SETTINGS = Settings(max_upload_bytes=1000)


@pytest.mark.parametrize("args,answer", [
    (("standard", "default", "clip.mp4", None, None), None),
    (("index", "p_1-x", "a.b", "1000", "k" * 255), None),
    (("urgent", "default", "clip.mp4", None, None),
     (422, "invalid_request", "unknown priority 'urgent'; choose one of archive, standard, index")),
    (("standard", "de fault", "clip.mp4", None, None),
     (422, "invalid_request", "profile 'de fault': 1-128 characters of A-Z a-z 0-9 . _ -")),
    (("standard", "default", "a.mp4\n", None, None),
     (422, "invalid_request", "filename 'a.mp4\\n': 1-128 characters of A-Z a-z 0-9 . _ -")),
    (("standard", "default", "..", None, None),
     (422, "invalid_request", "filename '..': 1-128 characters of A-Z a-z 0-9 . _ -")),
    (("standard", "default", "x" * 129, None, None), (422, "invalid_request", None)),
    (("standard", "default", "clip.mp4", "1001", None),
     (413, "limits_exceeded", "1001 bytes exceeds max_upload_bytes = 1000")),
    (("standard", "default", "clip.mp4", "-5", None), None),  # not a number: the body's size decides
    (("standard", "default", "clip.mp4", None, ""), (422, "invalid_request", "Idempotency-Key must be 1-255 characters")),
    (("standard", "default", "clip.mp4", None, "k" * 256), (422, "invalid_request", None)),
    (("urgent", "..", "clip.mp4", "5000", ""), (422, "invalid_request", None)),  # the tier is checked first
])
def test_check_request_judges_the_parameters_in_order(args, answer):
    refusal = check_request(*args, SETTINGS)
    if answer is None:
        assert refusal is None
        return
    status, error, reason = answer
    assert (refusal.status, refusal.error, refusal.retry_after_s) == (status, error, None)
    if reason is not None:
        assert refusal.reason == reason
    if args[0] == "urgent":
        assert "unknown priority" in refusal.reason


def test_a_key_names_one_request_and_one_body():
    first = {"priority": "standard", "profile": "default", "filename": "a.mp4"}
    assert key_reuse(first, "standard", "default", "a.mp4") is None
    other = key_reuse(first, "index", "default", "a.mp4")
    assert (other.status, other.error) == (422, "idempotency_key_reused")
    assert other.reason == ("Idempotency-Key already used with priority=standard, profile=default, filename=a.mp4; "
                            "a key names one request")
    assert body_reuse("ab" * 32, 10, "ab" * 32, 10) is None
    changed = body_reuse("ab" * 32, 10, "ab" * 32, 11)
    assert (changed.status, changed.error) == (422, "idempotency_key_reused")
    assert changed.reason == ("Idempotency-Key already used with a different body (sha256 abababababab..., 10 bytes); "
                              "a key names one upload")


def test_a_refusal_answers_retry_after_only_when_retrying_helps():
    assert Refusal(503, "overloaded", "busy", 7).headers() == {"Retry-After": "7"}
    assert Refusal(507, "storage_full", "full").headers() == {}
    assert Refusal(503, "overloaded", "busy", 7).body() == {"error": "overloaded", "reason": "busy", "retry_after_s": 7}
