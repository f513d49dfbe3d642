"""The one newest-first keyset pager (``scheduler/infra/keyset.py``): pages that follow each other
through rows created in the same instant give every row exactly once, newest first."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import DateTime, Integer, create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from scheduler.infra.keyset import newest_first_page, split_page


class _Base(DeclarativeBase):
    pass


class _Row(_Base):
    __tablename__ = "rows"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False)


def test_pages_follow_each_other_through_ties() -> None:
    engine = create_engine("sqlite://")
    _Base.metadata.create_all(engine)
    start = datetime(2026, 1, 1)  # naive: SQLite DateTime
    # 11 rows over 4 instants: ties that straddle page boundaries
    rows = [_Row(id=i, created_at=start + timedelta(seconds=i // 3)) for i in range(11)]
    expected = sorted(((r.created_at, r.id) for r in rows), reverse=True)
    with Session(engine) as session:
        session.add_all(rows)
        session.commit()
        seen: list[tuple[datetime, int]] = []
        after: tuple[datetime, int] | None = None
        pages = 0
        while True:
            page = newest_first_page(select(_Row), created_at=_Row.created_at, id_=_Row.id,
                                     after=after, limit=4)
            found, more = split_page(list(session.scalars(page)), 4)
            pages += 1
            assert len(found) == (4 if more else 3)
            seen += [(r.created_at, r.id) for r in found]
            if not more:
                break
            after = (found[-1].created_at, found[-1].id)
    assert pages == 3
    assert seen == expected
