"""Request and response models of ``/v1/admin/models`` (model versions and their activation)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints

from api.schemas.common import StrictModel

# A model name or version is one path component of the model store (see worker/model_store.py).
StoreComponent = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")]


class ActivateRequest(StrictModel):
    version: StoreComponent = Field(description="A registered version, or one published in the store.")


class CanaryRequest(StrictModel):
    version: StoreComponent = Field(description="The version to send a share of new jobs to.")
    # Routing keeps basis points (two decimals of a percent): 0.01 is the smallest share, 99.99 the largest.
    percent: float = Field(ge=0.01, le=99.99, description="Share of new jobs routed to it, in percent "
                           "(0.01-99.99; two decimals kept).")


class PromoteRequest(StrictModel):
    force: bool = Field(False, description="Promote although the promotion gate refuses.")


class CanaryOut(BaseModel):
    version: str
    percent: float
    started_at: datetime | None


class ModelVersionOut(BaseModel):
    version: str
    path: str = Field(description="Its folder in the model store (never copied by activation).")
    registered_at: datetime
    active: bool
    ready_workers: int = Field(description="Ready workers serving this version now.")


class ModelOut(BaseModel):
    name: str
    active_version: str | None = Field(description="The version workers serving this model switch to.")
    previous_version: str | None = Field(description="Activate it again to roll back.")
    generation: int = Field(description="Activations so far.")
    activated_at: datetime | None
    activated_by: str | None
    canary: CanaryOut | None = Field(None, description="The canary in effect, if any (cloverq model canary).")
    versions: list[ModelVersionOut]


class ModelList(BaseModel):
    items: list[ModelOut]
