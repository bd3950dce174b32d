"""Webhook endpoints in the admin API (`projections/api.py` includes `router`): register, list,
disable, enable and remove a submitter's endpoints under `/api/webhooks` (bearer admin token). They
call the app's `WebhookEndpoints` port (`projections/web_ports.py`, wired by `cli/wiring.py`); the
secret is in the answer to the registration only, never logged."""

from __future__ import annotations

from datetime import datetime

import structlog
from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import BaseModel, Field

from domain.errors import WebhookRefused
from domain.policy.webhooks import ALL_TYPES
from projections.api_deps import Web, require_admin, web
from projections.api_models import ACTIONS, NUL_FREE, OPERATOR_MAX, WHY_MAX, answers
from projections.web_ports import WebhookEndpoints

log = structlog.get_logger("tapeline.api")
router = APIRouter()

URL_MAX = 2000


class EndpointRequest(BaseModel):
    """An endpoint to register for a submitter's jobs."""

    submitter: str = Field(..., min_length=1, max_length=OPERATOR_MAX, pattern=NUL_FREE,
                           description="The submitter whose jobs notify it (an intake token's identity)")
    url: str = Field(..., min_length=1, max_length=URL_MAX, pattern=NUL_FREE,
                     description="http(s) URL; private, loopback and link-local addresses are refused unless allowed")
    event_types: list[str] = Field(default_factory=list, max_length=len(ALL_TYPES),
                                   description=f"Types wanted (empty: all): {', '.join(ALL_TYPES)}")
    secret: str | None = Field(None, max_length=200, pattern=NUL_FREE,
                               description="Signing secret whsec_<base64> (default: a new one, in this answer only)")


class Endpoint(BaseModel):
    """A registered endpoint (never its secret)."""

    endpoint_id: str
    submitter: str
    url: str
    event_types: list[str]
    enabled: bool
    created_at: datetime
    disabled_at: datetime | None = None
    disabled_reason: str | None = None
    failing_since: datetime | None = None
    last_success_at: datetime | None = None
    delivered: int = 0
    pending: int = 0
    dead_lettered: int = 0


class Registered(Endpoint):
    """The registration's answer: the endpoint with its secret, shown this once."""

    secret: str
    same_url: list[str] = Field(default_factory=list,
                                description="The submitter's other endpoints at this URL: each event goes to every "
                                            "one, with its own webhook-id and secret (remove the old one after a "
                                            "secret rotation)")


class Disable(BaseModel):
    why: str = Field("disabled by an operator", min_length=1, max_length=WHY_MAX, pattern=NUL_FREE)


def wired(context: Web) -> WebhookEndpoints:
    if context.webhooks is None:
        raise HTTPException(503, "this server has no webhook endpoints wired (see cli.wiring.build_app)")
    return context.webhooks


@router.post("/api/webhooks", tags=["webhooks"], response_model=Registered, status_code=201,
             responses=ACTIONS, dependencies=[Depends(require_admin)])
def register(body: EndpointRequest, context: Web = Depends(web)) -> Registered:
    """Register a webhook endpoint. The answer holds its signing secret: the only time it is shown.
    422 for a refused URL (a private address, say), an unknown event type or a bad secret."""
    try:
        row = wired(context).register(body.submitter, body.url, body.event_types, body.secret)
    except WebhookRefused as exc:
        raise HTTPException(422, str(exc)) from exc
    log.info("webhook endpoint registered", endpoint_id=row["endpoint_id"], submitter=row["submitter"])
    return Registered(**row)


@router.get("/api/webhooks", tags=["webhooks"], response_model=list[Endpoint], responses=answers(400, 401, 422, 503),
            dependencies=[Depends(require_admin)])
def endpoints(submitter: str | None = Query(None, max_length=OPERATOR_MAX, pattern=NUL_FREE),
              context: Web = Depends(web)) -> list[Endpoint]:
    """Endpoints (of one submitter), with their delivery counts; never their secrets."""
    return [Endpoint(**row) for row in wired(context).endpoints(submitter)]


@router.post("/api/webhooks/{endpoint_id}/disable", tags=["webhooks"], responses=ACTIONS,
             dependencies=[Depends(require_admin)])
def disable(endpoint_id: str, body: Disable | None = None, context: Web = Depends(web)) -> dict:
    """Stop delivering to an endpoint (the body, with `why`, is optional). 404 for an unknown one."""
    if not wired(context).set_enabled(endpoint_id, False, (body or Disable()).why):
        raise HTTPException(404, f"no webhook endpoint {endpoint_id!r}")
    return {"endpoint_id": endpoint_id, "enabled": False}


@router.post("/api/webhooks/{endpoint_id}/enable", tags=["webhooks"], responses=ACTIONS,
             dependencies=[Depends(require_admin)])
def enable(endpoint_id: str, context: Web = Depends(web)) -> dict:
    """Deliver to a disabled endpoint again. 404 for an unknown one."""
    if not wired(context).set_enabled(endpoint_id, True, None):
        raise HTTPException(404, f"no webhook endpoint {endpoint_id!r}")
    return {"endpoint_id": endpoint_id, "enabled": True}


@router.delete("/api/webhooks/{endpoint_id}", tags=["webhooks"], responses=ACTIONS,
               dependencies=[Depends(require_admin)])
def remove(endpoint_id: str, context: Web = Depends(web)) -> dict:
    """Remove an endpoint (deliveries not done are dead-lettered by the notifier). 404 for an unknown one."""
    if not wired(context).remove(endpoint_id):
        raise HTTPException(404, f"no webhook endpoint {endpoint_id!r}")
    return {"endpoint_id": endpoint_id, "removed": True}
