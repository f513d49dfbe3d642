"""Pure rules of the security layer: caller scopes, limit updates."""

from __future__ import annotations

import pytest

from api.auth import DEV_CALLER, Caller
from api.routes.admin import _limit_changes
from api.schemas.admin import LimitsUpdate
from scheduler.access.limit_overrides import validate_limit_field


def test_admin_scope_implies_every_scope_and_sees_all_tenants() -> None:
    admin = Caller(tenant="ops", scopes=frozenset({"admin"}), key_id="k")
    reader = Caller(tenant="acme", scopes=frozenset({"read"}), key_id="r")
    assert admin.has_scope("submit") and admin.has_scope("read") and admin.tenant_filter is None
    assert reader.has_scope("read") and not reader.has_scope("submit") and not reader.has_scope("admin")
    assert reader.tenant_filter == "acme"
    assert DEV_CALLER.tenant == "default" and DEV_CALLER.key_id is None and DEV_CALLER.is_admin


def test_limit_update_sets_and_clears_only_what_was_sent() -> None:
    update = LimitsUpdate.model_validate(
        {
            "rate_burst": 7,
            "tenant_max_active": None,
            "queue_max_depth": {"bulk": 10, "joint": None},
            "tenants": {"acme": {"max_active": 3}, "beta": {"max_active": None}, "gamma": {}},
            "keys": {"0123456789ab": {"rate_per_second": 0.5}},
        }
    )
    assert _limit_changes(update) == {
        "rate_burst": 7,
        "tenant_max_active": None,
        "queue_max_depth:bulk": 10,
        "queue_max_depth:joint": None,
        "tenant_max_active:acme": 3,
        "tenant_max_active:beta": None,
        "rate_per_second:0123456789ab": 0.5,
    }


def test_unknown_limit_fields_are_rejected() -> None:
    for good in ("rate_per_second", "rate_burst:abc", "queue_max_depth:bulk", "tenant_max_active:t"):
        validate_limit_field(good)
    for bad in ("rate", "queue_max_depth", "queue_max_depth:", "evil:x"):
        with pytest.raises(ValueError):
            validate_limit_field(bad)
