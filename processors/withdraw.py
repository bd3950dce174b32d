"""Withdrawing a job's published outputs once it ended otherwise than completed: the rule is
`domain/policy/withdrawal.py`; this module lists `published/{job}/`, removes what the rule says
(`ObjectStorage.withdraw_published`) and builds the `OutputsWithdrawn` that records it.

Three callers, so that no single crash leaves a cancelled or failed job's outputs public
(docs/design.md "Cancel, fail and publish: who wins"):
- `tapeline cancel` / `POST /api/jobs/J/cancel` (`processors/operator.py` `cancel_job`), once its
  `JobCancelled` is projected: what a running publish promoted before it saw the cancel;
- `tapeline dlq fail` (`_fail_one`), once its `JobFailed` is projected: what a dead-lettered
  publish had promoted;
- the publish worker (`processors/publish.py`) after its attempt ended, whatever the way (fenced by
  the cancel's projection, failed, or its completion superseded): the object it was writing when the
  operator's withdrawal listed the prefix.
Each removes whatever is there when it looks; a repeat finds nothing and records nothing.
"""

from __future__ import annotations

from typing import Any

import structlog

from domain import events as ev
from domain.policy.withdrawal import PublishedObject, Withdrawal, must_withdraw, plan_withdrawal
from processors.providers import published_prefix
from tapeline.ports import Clock, ObjectStorage

log = structlog.get_logger("tapeline.withdraw")

PAGE = 1000
"""Keys listed, and removed, per request (S3's DeleteObjects takes at most 1000)."""


def withdraw(store: ObjectStorage, job_id: str, state: str | None) -> Withdrawal:
    """Remove every object under `published/{job_id}/` when a job in `state` must have none
    (`domain.policy.withdrawal.must_withdraw`); returns what was removed (empty: nothing to do).
    Raises `StorageError` when the bucket cannot be listed or a delete fails (the caller says so;
    a repeat removes what is left)."""
    prefix, found, token = published_prefix(job_id), [], None
    if not must_withdraw(state):
        return plan_withdrawal(state, ())  # a state whose outputs stay: not even listed
    while True:
        page, token = store.list_page(prefix, token, PAGE)
        found += [PublishedObject(o.key, o.last_modified) for o in page]
        if token is None:
            break
    plan = plan_withdrawal(state, found)
    for start in range(0, len(plan.keys), PAGE):
        store.withdraw_published(list(plan.keys[start:start + PAGE]))
    if plan:
        log.warning("published outputs withdrawn", job_id=job_id, state=state, objects=len(plan.keys),
                    public_since=plan.public_since.isoformat() if plan.public_since else None)
    return plan


def withdrawn_event(row: dict[str, Any], plan: Withdrawal, withdrawn_by: str, recorded_by: str, *, clock: Clock,
                    claim_token: str | None = None) -> ev.OutputsWithdrawn:
    """The `OutputsWithdrawn` recording `plan` for the job of `row` (its projected `job_state`; the
    event goes on its current stage and attempt, the ending's reason as `reason`), stamped by `clock`.
    `withdrawn_by` is also the dedup key's sequence, so the operator's and the worker's withdrawals
    of one job are both kept. Pure."""
    return ev.OutputsWithdrawn.new(
        clock.stamp(), job_id=row["job_id"], stage=row["stage"], attempt=row["attempt"], recorded_by=recorded_by,
        correlation_id=row.get("upload_id") or row["job_id"], claim_token=claim_token,
        sequence=withdrawn_by.replace(" ", "_"), keys=list(plan.keys), public_since=plan.public_since,
        withdrawn_by=withdrawn_by, reason=f"job {row['state']}" + (f": {row['reason']}" if row.get("reason") else ""))
