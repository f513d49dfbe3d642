"""Keyset paging, newest first: the one way the product lists rows a page at a time.

A page is ordered by ``(created_at DESC, id DESC)`` and starts strictly after the last row the
reader saw (its ``created_at`` and ``id``: the *key*), never at an OFFSET, so a page costs the
same wherever it is and a row inserted meanwhile neither repeats nor hides another. The id breaks
ties between rows created in the same instant. One row more than the page is read, so the caller
knows whether another page follows without a count.

Used by ``GET /v1/jobs`` (``scheduler/jobs/service.py`` ``list_jobs``: the key travels in an opaque
cursor) and the OpenAI Files and Batches lists (``scheduler/batches/openai_batches.py``: the key
is the row named by ``after``). A batch's own jobs are paged in submission order instead
(``scheduler/batches/service.py`` ``iter_batch_jobs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import InstrumentedAttribute

T = TypeVar("T")
S = TypeVar("S", bound=Select)  # any Select (its row types are the caller's)


def newest_first_page(
    query: S, *, created_at: InstrumentedAttribute[datetime], id_: InstrumentedAttribute[Any],
    after: tuple[datetime, Any] | None, limit: int,
) -> S:
    """``query`` ordered newest first, from just after the key ``after`` (``(created_at, id)`` of
    the last row seen; None: from the newest), ``limit + 1`` rows (see :func:`split_page`)."""
    if after is not None:
        created, last_id = after
        query = query.where(or_(created_at < created, and_(created_at == created, id_ < last_id)))
    return query.order_by(created_at.desc(), id_.desc()).limit(limit + 1)


def split_page(rows: Sequence[T], limit: int) -> tuple[list[T], bool]:
    """The page of ``rows`` read with :func:`newest_first_page` and whether another page follows."""
    return list(rows[:limit]), len(rows) > limit
