"""The audit trail: one structured log line per admin action and per key change.

Lines go to the logger ``cloverq.audit`` with ``audit=True`` and event ``audit.<action>``, so
an operator can route or filter them (``jq 'select(.audit)'``). They name the actor by tenant
and key id (never the key itself; ``scheduler.observability.redaction`` would mask one anyway), the target
and the outcome. Emitted after the change succeeded, so the trail never claims an action that
did not happen; refused admin calls (401/403) are logged by the API as ordinary warnings.
"""

from __future__ import annotations

from typing import Any

import structlog

_log = structlog.get_logger("cloverq.audit")


def audit(action: str, *, actor_tenant: str | None, actor_key_id: str | None, via: str,
          target: str | None = None, **details: Any) -> None:
    """Write one audit line. ``via`` is ``api`` or ``cli``; ``details`` must not hold secrets."""
    _log.info(
        f"audit.{action}",
        audit=True,
        action=action,
        actor_tenant=actor_tenant,
        actor_key_id=actor_key_id,
        via=via,
        target=target,
        **details,
    )
