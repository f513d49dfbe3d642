"""Weighted fair share inside each priority class (docs/architecture.md §3.4, "Fair share").

Inside a class the broker list is first in, first out, so a tenant that submits thousands of
jobs would make every other tenant's work of that class wait behind all of it. Fair share keeps
each class's Celery list short (``scheduling.fair_share_window`` messages) while jobs wait, and
holds the rest as ``queued`` rows without a message; whenever the list has room, the next jobs
are released by deficit round robin across flows (a tenant's batch, or its single jobs), each
tenant's weight split evenly among its flows. SQL stays the system of record and Celery on Redis
the transport: the held jobs' index in Redis is rebuilt from SQL by the reconciler like any
lost message.

- ``drr.py``: the policy, pure (no Redis, no SQL): which flow releases next.
- ``weights.py``: per-tenant weights (operator overrides, SQL first, mirrored in Redis).
- ``held.py``: the held jobs in Redis (stage, take, forget) and their counts.
- ``release.py``: one release pass and its lock (who publishes the next jobs, and when).
- ``gate.py``: what the publishing paths (submit, batches, reconciler, delayed tick) call.
- ``kicker.py``: a process's background releaser (workers kick it for every message taken).
- ``tasks.py``: the beat tick, the backstop.
"""
