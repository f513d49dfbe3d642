"""``/v1/webhooks``: a tenant reads (or rotates) the secret its webhooks are signed with.

Both need the ``webhooks`` scope (or ``admin``): the secret lets its holder forge signed
deliveries and a rotation breaks every receiver, so a submit-only key may do neither (issue 31).

Verification, for receivers: take ``t`` and ``v1`` from ``X-Cloverq-Signature: t=<ts>,v1=<hex>``,
compute ``HMAC-SHA256(secret, "<t>." + raw_body)`` in hex, compare in constant time, and
reject timestamps older than a few minutes (replays). See ``scheduler.webhooks.signing``.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from api.deps import SessionDep, WebhooksCaller
from api.schemas.errors import error_responses
from scheduler.observability.audit import audit
from scheduler.webhooks import signing

# 429: every authenticated route is rate-limited per key (api.auth).
router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], responses=error_responses(429))


class WebhookSecretOut(BaseModel):
    """The caller's tenant secret and how signatures are built with it."""

    tenant: str
    secret: str
    algorithm: str = "HMAC-SHA256"
    header: str = signing.SIGNATURE_HEADER
    format: str = "t=<unix seconds>,v1=<hex HMAC-SHA256(secret, '<t>.' + body)>"


@router.get("/secret", response_model=WebhookSecretOut, responses=error_responses(401, 403, 503))
def get_secret(session: SessionDep, caller: WebhooksCaller) -> WebhookSecretOut:
    """The signing secret of the caller's tenant (created on first use)."""
    secret = signing.tenant_secret(session, tenant=caller.tenant)
    return WebhookSecretOut(tenant=caller.tenant, secret=secret)


@router.post("/secret/rotate", response_model=WebhookSecretOut, responses=error_responses(401, 403, 503))
def rotate_secret(session: SessionDep, caller: WebhooksCaller) -> WebhookSecretOut:
    """Replace the tenant's secret; deliveries from now on are signed with the new one."""
    secret = signing.rotate_secret(session, tenant=caller.tenant)
    audit("webhook_secret.rotate", actor_tenant=caller.tenant, actor_key_id=caller.key_id, via="api",
          target=caller.tenant)
    return WebhookSecretOut(tenant=caller.tenant, secret=secret)
