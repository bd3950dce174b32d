"""What the read API shows a caller without the admin token: the public view of a read's answer.

The dashboard and `/api` reads are open to anyone who can reach them (operators, on-call, analysts).
Three kinds of fact in their answers are not for anyone (issue 44 item 5):

- **fencing tokens**: an attempt's `claim_token` and the notifier leader's `notifier_token`. An
  ending event is applied only with the running attempt's claim (`domain/lifecycle.py`), so a token
  read from the API is what a forged event needs;
- **the sha256 and size of an object that is not public**: an attempt's `work/` outputs and
  checkpoints and the claim `markers/`. A forged `UploadCompleted` took both from the timeline API
  to name an unpublished segment of a cancelled job (the intake now refuses objects outside the
  upload's own prefix as well: `domain/policy/intake_decision.py`). What stays shown: the digest and
  size of published outputs (anyone can read those objects) and of the job's own source upload
  (its identity: "same source" look-ups, the job page);
- **a dead letter's raw record** (key, value, headers): producers' bytes, possibly a customer's data.

With the admin token (`Authorization: Bearer`) the API answers everything. `public_view` is the one
place the rule lives; the API applies it to every job read (`projections/api_reads.py`).
"""

from __future__ import annotations

from typing import Any

SHOWN_OBJECT_PREFIXES = ("published/", "uploads/")
"""Key prefixes whose objects' sha256 and size are shown to everyone: published outputs and sources."""

OBJECT_KEY_FIELDS = ("key", "object_key")
"""Fields that name the object a mapping describes (an output: `key`; a checkpoint or upload: `object_key`)."""

OBJECT_FACTS = ("sha256", "size_bytes")
"""The facts of an object that are withheld unless the object is shown."""

WITHHELD_FIELDS = ("claim_token", "notifier_token")
"""Fields withheld wherever they appear, at any depth."""

RAW_RECORD_FIELDS = ("key", "value", "headers")
"""A dead letter's raw record: withheld from its answer as a whole (`public_dead_letter`)."""


def public_view(value: Any) -> Any:
    """`value` (a JSON-ready answer: dicts, lists, scalars) with what a caller without the admin
    token may not see set to None: every `WITHHELD_FIELDS` field, and `OBJECT_FACTS` of every
    mapping whose `OBJECT_KEY_FIELDS` key is not under a `SHOWN_OBJECT_PREFIXES` prefix. Keys and
    shape are kept (a typed client still parses it). Pure; returns new containers."""
    if isinstance(value, list):
        return [public_view(item) for item in value]
    if not isinstance(value, dict):
        return value
    named = next((value[f] for f in OBJECT_KEY_FIELDS if isinstance(value.get(f), str)), None)
    hidden_facts = named is not None and not named.startswith(SHOWN_OBJECT_PREFIXES)
    return {k: None if k in WITHHELD_FIELDS or (hidden_facts and k in OBJECT_FACTS) else public_view(v)
            for k, v in value.items()}


def public_dead_letter(letter: dict[str, Any]) -> dict[str, Any]:
    """A dead letter's answer (`letter_json(raw=True)`) without its raw record: `RAW_RECORD_FIELDS`
    set to None (their size stays in `value_bytes` where the read gives it). Pure."""
    return {k: None if k in RAW_RECORD_FIELDS else v for k, v in public_view(letter).items()}
