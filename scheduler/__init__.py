"""The job domain: everything between the API and the GPU workers, with no HTTP and no torch.

Core modules (see docs/architecture.md §3.1-3.5):

- ``models`` / ``db`` / ``migrations/``: the ``jobs`` table (system of record), engines, Alembic.
- ``jobs``: submit / get / list / cancel / read_progress (keyword-only service functions).
- ``routing``: cost estimate (tokens x steps x questions), priority class, queue.
- ``celery_app`` / ``enqueue``: the Celery app on Redis; publishing a job id + its marker.
- ``lifecycle``: fenced claim / renew / finish / retry (guarded by ``(id, attempt)``).
- ``maintenance`` / ``beat``: reconciler (+ aging), reaper, expiry, and their schedule.
- ``workers``: the worker registry in Redis (readiness, queues, model version).
- ``retry``: which faults are retried and the backoff with jitter.

``scheduler`` imports neither ``api`` nor ``worker``.
"""
