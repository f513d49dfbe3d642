"""OpenAI's Batch API on top of cloverq batches: uploaded files and the batches made from them.

An uploaded file (``purpose: batch``, JSONL of ``{"custom_id", "method", "url", "body"}``
requests) is a row of ``openai_files`` (its bytes in SQL, the system of record; the upload is
bounded by ``batch_max_body_bytes``). Creating an OpenAI batch from it creates ONE cloverq batch
(``scheduler/batches/service.py``: one job per line, the same transaction, order, admission and queues
as ``POST /v1/batches``) plus a row of ``openai_batches`` that remembers, per line in order, its
``custom_id`` and what its answer needs (model, stop sequences). The output and error files are
not stored: they are rendered from the batch's jobs whenever they are read.
"""

from __future__ import annotations

import builtins
import secrets
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Integer, LargeBinary, String, Uuid, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from scheduler.infra.keyset import newest_first_page, split_page
from scheduler.jobs.models import Base, Job, JSONType, UTCDateTime, utcnow

OUTPUT_SUFFIX = "-output"
ERRORS_SUFFIX = "-errors"


class OpenAIFile(Base):
    """An uploaded file (OpenAI Files API)."""

    __tablename__ = "openai_files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), nullable=False, index=True)
    purpose: Mapped[str] = mapped_column(String(32), nullable=False)
    filename: Mapped[str] = mapped_column(String(255), nullable=False)
    bytes: Mapped[int] = mapped_column(Integer, nullable=False)
    content: Mapped[builtins.bytes] = mapped_column(LargeBinary, nullable=False)  # `bytes` is a column
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)


class OpenAIBatch(Base):
    """An OpenAI batch: which cloverq batch runs it and the ``custom_id`` of each of its jobs."""

    __tablename__ = "openai_batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), nullable=False, index=True)
    # indexed: the purge finds the OpenAI batch of a purged job's batch (0014_retention)
    batch_id: Mapped[uuid.UUID] = mapped_column(Uuid(as_uuid=True), nullable=False, index=True)
    input_file_id: Mapped[str] = mapped_column(String(64), nullable=False)
    endpoint: Mapped[str] = mapped_column(String(64), nullable=False)
    completion_window: Mapped[str] = mapped_column(String(16), nullable=False)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONType, nullable=True)
    # per line, in submission order: {"custom_id", "model", "stop", "echo"}
    requests: Mapped[list[dict[str, Any]]] = mapped_column(JSONType, nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def output_file_id(batch_id: str) -> str:
    return f"file-{batch_id}{OUTPUT_SUFFIX}"


def error_file_id(batch_id: str) -> str:
    return f"file-{batch_id}{ERRORS_SUFFIX}"


def rendered_file(file_id: str) -> tuple[str, str] | None:
    """``(openai batch id, "output" | "errors")`` for the id of a rendered file, else None."""
    for suffix, kind in ((OUTPUT_SUFFIX, "output"), (ERRORS_SUFFIX, "errors")):
        if file_id.startswith("file-batch_") and file_id.endswith(suffix):
            return file_id[len("file-"):-len(suffix)], kind
    return None


def create_file(session: Session, *, tenant: str, purpose: str, filename: str, content: bytes) -> OpenAIFile:
    row = OpenAIFile(id=new_file_id(), tenant=tenant, purpose=purpose, filename=filename,
                     bytes=len(content), content=content, created_at=utcnow())
    session.add(row)
    session.commit()
    return row


def get_file(session: Session, *, file_id: str, tenant: str | None) -> OpenAIFile | None:
    row = session.get(OpenAIFile, file_id)
    if row is None or (tenant is not None and row.tenant != tenant):
        return None
    return row


def list_files(session: Session, *, tenant: str | None, purpose: str | None = None, limit: int = 100,
               after: str | None = None) -> tuple[list[OpenAIFile], bool]:
    """Newest first; ``(files, has_more)``. The content column is not loaded."""
    query = select(OpenAIFile.id, OpenAIFile.tenant, OpenAIFile.purpose, OpenAIFile.filename,
                   OpenAIFile.bytes, OpenAIFile.created_at)
    if tenant is not None:
        query = query.where(OpenAIFile.tenant == tenant)
    if purpose is not None:
        query = query.where(OpenAIFile.purpose == purpose)
    anchor = session.get(OpenAIFile, after) if after is not None else None
    page = newest_first_page(query, created_at=OpenAIFile.created_at, id_=OpenAIFile.id,
                             after=_key(anchor), limit=limit)
    rows, more = split_page(session.execute(page).all(), limit)
    files = [OpenAIFile(id=r.id, tenant=r.tenant, purpose=r.purpose, filename=r.filename, bytes=r.bytes,
                        content=b"", created_at=r.created_at) for r in rows]
    return files, more


def _key(anchor: OpenAIFile | OpenAIBatch | None) -> tuple[datetime, str] | None:
    """The keyset key of the row an ``after`` names (an unknown id: from the newest)."""
    return None if anchor is None else (anchor.created_at, anchor.id)


def delete_file(session: Session, *, file_id: str, tenant: str | None) -> bool:
    row = get_file(session, file_id=file_id, tenant=tenant)
    if row is None:
        return False
    session.delete(row)
    session.commit()
    return True


def create_openai_batch(session: Session, *, batch_id: str, tenant: str, cloverq_batch_id: uuid.UUID,
                        input_file_id: str, endpoint: str, completion_window: str,
                        metadata: Mapping[str, Any] | None,
                        requests: Sequence[Mapping[str, Any]]) -> OpenAIBatch:
    row = OpenAIBatch(id=batch_id, tenant=tenant, batch_id=cloverq_batch_id, input_file_id=input_file_id,
                      endpoint=endpoint, completion_window=completion_window,
                      meta=dict(metadata) if metadata else None, requests=[dict(r) for r in requests],
                      created_at=utcnow())
    session.add(row)
    session.commit()
    return row


def get_openai_batch(session: Session, *, batch_id: str, tenant: str | None) -> OpenAIBatch | None:
    row = session.get(OpenAIBatch, batch_id, populate_existing=True)
    if row is None or (tenant is not None and row.tenant != tenant):
        return None
    return row


def list_openai_batches(session: Session, *, tenant: str | None, limit: int = 20,
                        after: str | None = None) -> tuple[list[OpenAIBatch], bool]:
    query = select(OpenAIBatch)
    if tenant is not None:
        query = query.where(OpenAIBatch.tenant == tenant)
    anchor = session.get(OpenAIBatch, after) if after is not None else None
    page = newest_first_page(query, created_at=OpenAIBatch.created_at, id_=OpenAIBatch.id,
                             after=_key(anchor), limit=limit)
    return split_page(list(session.scalars(page)), limit)


def mark_cancelling(session: Session, row: OpenAIBatch) -> None:
    if row.cancelling_at is None:
        row.cancelling_at = utcnow()
        session.commit()


def last_finished_at(session: Session, batch_id: uuid.UUID) -> datetime | None:
    """When the batch's last job finished (its jobs carry the time; the batch row does not)."""
    return session.scalar(select(func.max(Job.finished_at)).where(Job.batch_id == batch_id))
