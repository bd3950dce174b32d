"""`tapeline timeline`'s detail column for the notifier's events: which endpoint, which try and what
it answered (docs/operating.md "Customer webhooks": each try is in the job's timeline with its
status). Before, a NotificationDelivered showed nothing and a NotificationFailed only its reason."""

from __future__ import annotations

from projections.presenter import timeline_detail


def row(event_type: str, **payload) -> dict:
    return {"event_type": event_type, "stage": "notify", "attempt": 0, "payload": payload}


def test_a_delivery_names_its_endpoint_try_and_status():
    shown = timeline_detail(row("NotificationDelivered", delivery_id="msg_1", endpoint_id="ep_1", try_number=2,
                        http_status=200, elapsed_s=0.012, notifier_token="t"))
    assert shown == "endpoint_id=ep_1 try_number=2 http_status=200 elapsed_s=0.012"


def test_a_failure_names_its_status_reason_and_next_try_and_no_answer_has_no_status():
    shown = timeline_detail(row("NotificationFailed", delivery_id="msg_1", endpoint_id="ep_1", try_number=1,
                        http_status=500, reason="HTTP 500, a failure", retry_at="2026-12-05T23:34:08Z"))
    assert shown == ("endpoint_id=ep_1 try_number=1 http_status=500 reason=HTTP 500, a failure "
                     "retry_at=2026-12-05T23:34:08Z")
    hung = timeline_detail(row("NotificationFailed", endpoint_id="ep_1", try_number=1, http_status=None,
                       reason="timeout after 10 s", retry_at=None))
    assert hung == "endpoint_id=ep_1 try_number=1 reason=timeout after 10 s"


def test_an_intent_names_its_type_and_endpoint():
    assert timeline_detail(row("NotificationIntended", notification_type="job.failed", endpoint_id="ep_1",
                       delivery_id="msg_1")) == "notification_type=job.failed endpoint_id=ep_1"
