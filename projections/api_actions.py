"""Operator actions (`projections/api.py` includes `router`): replay a dead letter, fail one for good,
dismiss an undecodable record's, cancel a job, resolve a review, as JSON endpoints under `/api` (bearer admin token, `api_deps.require_admin`) and
as the dashboard's form posts under `/ui` (a token field). They call the app's `OperatorActions`
port (`projections/web_ports.py`): they emit events and never write a projection."""

from __future__ import annotations

from typing import Any, Callable, Literal
from urllib.parse import quote

import structlog
from fastapi import APIRouter, Depends, Form, HTTPException, Request
from fastapi.responses import RedirectResponse, Response

from domain.errors import NoSuchDeadLetter, NotCancellable, NotReplayable, TapelineError
from projections.api_deps import Web, client_of, job_or_404, page, require_admin, token_ok, web
from projections.api_models import (ACTIONS, ID_MAX, NUL_FREE, OPERATOR_MAX, TOKEN_MAX, WHY_MAX, Action, ActionResult,
                                    DismissRequest, FailRequest, ReplayRequest, ResolveRequest)
from projections.web_ports import OperatorActions
from projections import read_model as read

log = structlog.get_logger("tapeline.api")
router = APIRouter()


def wired(context: Web) -> OperatorActions:
    """The app's operator actions; raises HTTPException 503 when this server has none."""
    if context.actions is None:
        raise HTTPException(503, "this server has no operator actions wired (see cli.wiring.build_app)")
    return context.actions


def do_replay(context: Web, dead_letter_id: str, operator: str, why: str, client: str) -> ActionResult:
    """Replay one dead letter of a job. Raises HTTPException 404 for an unknown id, 409 for an
    undecodable-record dead letter (no job to replay), 503 without operator actions."""
    with context.pool.connection() as conn:
        letter = read.dead_letter(conn, dead_letter_id)
    if letter is None:
        raise HTTPException(404, f"no dead letter {dead_letter_id!r}")
    if letter["kind"] != "job":
        raise HTTPException(409, f"dead letter {dead_letter_id} is an undecodable record ({letter['error']}); "
                                 "it has no job to replay")
    [outcome] = wired(context).replay_dead_letters([dead_letter_id], operator, why)
    _record(context, "replay", outcome.replayed, job_id=outcome.job_id, operator=operator, client=client)
    return ActionResult(action="replay", job_id=outcome.job_id, done=outcome.replayed, detail=outcome.detail,
                        next_attempt=outcome.next_attempt)


def do_fail(context: Web, dead_letter_id: str, operator: str, why: str, refund: bool, client: str) -> ActionResult:
    """Fail one dead-lettered job for good (optionally refunding its submitter's quota). Raises
    HTTPException 404 for an unknown id, 409 for an undecodable-record dead letter, 503 without
    operator actions; `done` is false (and `detail` says why) when it was already failed."""
    with context.pool.connection() as conn:
        letter = read.dead_letter(conn, dead_letter_id)
    if letter is None:
        raise HTTPException(404, f"no dead letter {dead_letter_id!r}")
    if letter["kind"] != "job":
        raise HTTPException(409, f"dead letter {dead_letter_id} is an undecodable record ({letter['error']}); "
                                 "it has no job to fail")
    [outcome] = wired(context).fail_dead_letters([dead_letter_id], operator, why, refund)
    _record(context, "fail", outcome.failed, job_id=outcome.job_id, operator=operator, client=client, refund=refund)
    return ActionResult(action="fail", job_id=outcome.job_id, done=outcome.failed, detail=outcome.detail)


def do_dismiss(context: Web, dead_letter_id: str, operator: str, why: str, client: str) -> ActionResult:
    """Dismiss one undecodable record's dead letter (`DeadLetterDismissed`). Raises HTTPException 404
    for an unknown id, 409 for a job's dead letter (replay or fail it), 503 without operator actions;
    `done` is false (and `detail` says by whom) when it was already dismissed."""
    try:
        [outcome] = wired(context).dismiss_dead_letters([dead_letter_id], operator, why)
    except NoSuchDeadLetter as exc:
        raise HTTPException(404, str(exc)) from exc
    except NotReplayable as exc:
        raise HTTPException(409, str(exc)) from exc
    _record(context, "dismiss", outcome.dismissed, dead_letter_id=dead_letter_id, operator=operator, client=client)
    return ActionResult(action="dismiss", job_id=None, done=outcome.dismissed, detail=outcome.detail)


def do_cancel(context: Web, job_id: str, operator: str, why: str, client: str) -> ActionResult:
    """Cancel a job. Raises HTTPException 404 for an unknown job, 409 for one that cannot be
    cancelled (`NotCancellable`), 503 without operator actions."""
    with context.pool.connection() as conn:
        job_or_404(conn, job_id)
    try:
        detail = wired(context).cancel_job(job_id, operator, why)
    except NotCancellable as exc:
        raise HTTPException(409, str(exc)) from exc
    _record(context, "cancel", True, job_id=job_id, operator=operator, client=client)
    return ActionResult(action="cancel", job_id=job_id, done=True, detail=detail)


def do_resolve(context: Web, job_id: str, body: ResolveRequest, client: str) -> ActionResult:
    """Resolve a job in needs_review as `body` says. Raises HTTPException 404 for an unknown job,
    409 when it is not in needs_review or the resolution is refused (`NotReplayable`), 503 without
    operator actions."""
    with context.pool.connection() as conn:
        row = job_or_404(conn, job_id)
    if row["state"] != "needs_review":
        raise HTTPException(409, f"job {job_id} is {row['state']}, not needs_review")
    try:
        detail = wired(context).resolve_review(job_id, body.operator, body.why, body.posted_ref)
    except NotReplayable as exc:
        raise HTTPException(409, str(exc)) from exc
    _record(context, "resolve_review", True, job_id=job_id, operator=body.operator, client=client)
    return ActionResult(action="resolve_review", job_id=job_id, done=True, detail=detail)


def _record(context: Web, action: str, done: bool, **fields: Any) -> None:
    context.metrics.actions.labels(action=action, result="done" if done else "unchanged").inc()
    log.info("operator action", action=action, done=done, **fields)


# -- the JSON actions ---------------------------------------------------------------------------


@router.post("/api/dead-letters/replay", tags=["actions"], response_model=ActionResult, responses=ACTIONS,
             dependencies=[Depends(require_admin)])
def replay(body: ReplayRequest, request: Request, context: Web = Depends(web)) -> ActionResult:
    """Reopen a dead-lettered job with a fresh attempt budget (`JobReplayed` + the next attempt).
    Idempotent: `done` is false when it was already replayed. 401 without the token, 404 for an
    unknown id, 409 for an undecodable-record dead letter."""
    return do_replay(context, body.dead_letter_id, body.operator, body.why, client_of(request))


@router.post("/api/dead-letters/fail", tags=["actions"], response_model=ActionResult, responses=ACTIONS,
             dependencies=[Depends(require_admin)])
def fail_letter(body: FailRequest, request: Request, context: Web = Depends(web)) -> ActionResult:
    """End a dead-lettered job as failed for good (`JobFailed` with operator and reason; the
    customer's job.failed webhook); `refund` credits its submitter's daily quota back. Idempotent:
    `done` is false when it was already failed. 401 without the token, 404 for an unknown id, 409 for
    an undecodable-record dead letter."""
    return do_fail(context, body.dead_letter_id, body.operator, body.why, body.refund, client_of(request))


@router.post("/api/dead-letters/dismiss", tags=["actions"], response_model=ActionResult, responses=ACTIONS,
             dependencies=[Depends(require_admin)])
def dismiss_letter(body: DismissRequest, request: Request, context: Web = Depends(web)) -> ActionResult:
    """Close an undecodable record's dead letter, which has no job to replay or fail
    (`DeadLetterDismissed` with operator and reason, on the dead-letter topic): it leaves the pending
    list and the dead-letter alert; its record stays readable. Idempotent: `done` is false when it
    was already dismissed. 401 without the token, 404 for an unknown id, 409 for a job's dead letter."""
    return do_dismiss(context, body.dead_letter_id, body.operator, body.why, client_of(request))


@router.post("/api/jobs/{job_id}/cancel", tags=["actions"], response_model=ActionResult, responses=ACTIONS,
             dependencies=[Depends(require_admin)])
def cancel(job_id: str, body: Action, request: Request, context: Web = Depends(web)) -> ActionResult:
    """Cancel a job that has not ended (`JobCancelled` with operator and reason). 401 without the
    token, 404 for an unknown job, 409 for an ended one."""
    return do_cancel(context, job_id, body.operator, body.why, client_of(request))


@router.post("/api/jobs/{job_id}/resolve-review", tags=["actions"], response_model=ActionResult, responses=ACTIONS,
             dependencies=[Depends(require_admin)])
def resolve(job_id: str, body: ResolveRequest, request: Request, context: Web = Depends(web)) -> ActionResult:
    """Resolve a job in needs_review: `posted_ref` records the post you found and completes the job;
    `not_posted` releases the claim marker and queues the next publish attempt. 401 without the
    token, 404 for an unknown job, 409 when it is not in needs_review."""
    return do_resolve(context, job_id, body, client_of(request))


# -- the dashboard's forms ----------------------------------------------------------------------


def form_action(request: Request, context: Web, action: str, token: str, back: str,
                run: Callable[[], ActionResult]) -> Response:
    """Run a dashboard form's action: 401 page for a wrong token (nothing changed); otherwise a 303
    to the job's page (or `back`) with the signed outcome, or to `back` with the signed error."""
    if not token_ok(context.settings, token):
        context.metrics.actions.labels(action=action, result="unauthorized").inc()
        reason = ("actions are disabled: the server has no TAPELINE_ADMIN_TOKEN" if not context.settings.admin_token
                  else "wrong admin token: nothing was changed")
        return page(request, "not_found.html", 401, what=reason, title="401 Unauthorized")
    flasher = context.flasher
    try:
        result = run()
    except HTTPException as exc:
        return RedirectResponse(f"{back}?{flasher.query('err', str(exc.detail))}", status_code=303)
    except TapelineError as exc:
        return RedirectResponse(f"{back}?{flasher.query('err', str(exc))}", status_code=303)
    target = f"/jobs/{quote(result.job_id, safe='')}" if result.job_id else back
    return RedirectResponse(f"{target}?{flasher.query('msg', f'{result.action}: {result.detail}')}",
                            status_code=303)


@router.post("/ui/dead-letters/replay", include_in_schema=False)
def replay_form(request: Request, dead_letter_id: str = Form(..., max_length=ID_MAX, pattern=NUL_FREE), token: str = Form("", max_length=TOKEN_MAX, pattern=NUL_FREE),
                operator: str = Form(..., min_length=1, max_length=OPERATOR_MAX, pattern=NUL_FREE),
                why: str = Form(..., min_length=1, max_length=WHY_MAX, pattern=NUL_FREE),
                anyway: str = Form("", max_length=8, pattern=NUL_FREE), context: Web = Depends(web)) -> Response:
    """The dashboard's replay. A dead letter whose job would most likely fail the same way again
    (its diagnosis is permanent) is replayed only with `anyway` (the job page's "Replay anyway",
    under its warning); without it the answer says why and nothing is replayed. The CLI and the
    JSON API replay as asked."""
    def replay():
        letter_id = dead_letter_id.strip()
        if not anyway:
            with context.pool.connection() as conn:
                warning = read.replay_warning(conn, letter_id)
            if warning:
                raise TapelineError(f"not replayed: it would most likely fail again ({warning}); "
                                    "its job page offers Replay anyway")
        return do_replay(context, letter_id, operator, why, client_of(request))

    return form_action(request, context, "replay", token, "/dead-letters", replay)


@router.post("/ui/dead-letters/fail", include_in_schema=False)
def fail_form(request: Request, dead_letter_id: str = Form(..., max_length=ID_MAX, pattern=NUL_FREE),
              token: str = Form("", max_length=TOKEN_MAX, pattern=NUL_FREE),
              operator: str = Form(..., min_length=1, max_length=OPERATOR_MAX, pattern=NUL_FREE),
              why: str = Form(..., min_length=1, max_length=WHY_MAX, pattern=NUL_FREE),
              refund: str = Form("", max_length=8, pattern=NUL_FREE), context: Web = Depends(web)) -> Response:
    """The dashboard's "Fail for good" (the dead-letter view's form)."""
    return form_action(request, context, "fail", token, "/dead-letters",
                       lambda: do_fail(context, dead_letter_id.strip(), operator, why, bool(refund),
                                       client_of(request)))


@router.post("/ui/dead-letters/dismiss", include_in_schema=False)
def dismiss_form(request: Request, dead_letter_id: str = Form(..., max_length=ID_MAX, pattern=NUL_FREE),
                 token: str = Form("", max_length=TOKEN_MAX, pattern=NUL_FREE),
                 operator: str = Form(..., min_length=1, max_length=OPERATOR_MAX, pattern=NUL_FREE),
                 why: str = Form(..., min_length=1, max_length=WHY_MAX, pattern=NUL_FREE),
                 context: Web = Depends(web)) -> Response:
    """The dashboard's "Dismiss" (the dead-letter view's form, for undecodable records)."""
    return form_action(request, context, "dismiss", token, "/dead-letters",
                       lambda: do_dismiss(context, dead_letter_id.strip(), operator, why, client_of(request)))


@router.post("/ui/jobs/{job_id}/cancel", include_in_schema=False)
def cancel_form(request: Request, job_id: str, token: str = Form("", max_length=TOKEN_MAX, pattern=NUL_FREE),
                operator: str = Form(..., min_length=1, max_length=OPERATOR_MAX, pattern=NUL_FREE),
                why: str = Form(..., min_length=1, max_length=WHY_MAX, pattern=NUL_FREE),
                context: Web = Depends(web)) -> Response:
    """The dashboard's cancel (the job page's form)."""
    return form_action(request, context, "cancel", token, f"/jobs/{quote(job_id, safe='')}",
                       lambda: do_cancel(context, job_id, operator, why, client_of(request)))


@router.post("/ui/jobs/{job_id}/resolve-review", include_in_schema=False)
def resolve_form(request: Request, job_id: str, token: str = Form("", max_length=TOKEN_MAX, pattern=NUL_FREE),
                 operator: str = Form(..., min_length=1, max_length=OPERATOR_MAX, pattern=NUL_FREE),
                 why: str = Form(..., min_length=1, max_length=WHY_MAX, pattern=NUL_FREE),
                 finding: Literal["posted", "not_posted"] = Form(...),
                 posted_ref: str = Form("", max_length=ID_MAX, pattern=NUL_FREE),
                 context: Web = Depends(web)) -> Response:
    """The dashboard's review resolution: `finding` posted (with the post's ref) or not_posted."""
    back = f"/jobs/{quote(job_id, safe='')}"

    def run() -> ActionResult:
        try:
            ref = (posted_ref.strip() or None) if finding == "posted" else None
            body = ResolveRequest(operator=operator, why=why, posted_ref=ref, not_posted=finding == "not_posted")
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from exc
        return do_resolve(context, job_id, body, client_of(request))
    return form_action(request, context, "resolve_review", token, back, run)
