"""The job domain: everything between the API and the GPU workers, with no HTTP and no torch.

Subpackages, one concern each (see docs/architecture.md §3.1-3.5):

- ``infra``: what every process shares — settings, SQL engine and sessions, the Redis client,
  every Redis key and queue name, the Celery app and its transport, the beat schedule, process exit,
  and the ``gc.freeze`` of the start-up heap.
- ``jobs``: the ``jobs`` table (system of record) and the job's life — submit / get / list / cancel
  (``service``), cost and priority (``routing``), publishing (``enqueue``), fenced claim / renew /
  finish (``lifecycle``), retry policy, error codes, the finished notice and the event stream.
- ``batches``: many jobs in one transaction, and OpenAI's Batch API on top of them.
- ``model_versions``: registered versions, the active one, and canary releases.
- ``access``: API keys (authentication, scopes, revocation) and admission (rate, queue, tenant caps).
- ``fleet``: the worker registry, queue drains, and the operator state mirrored from SQL to Redis.
- ``webhooks``: signed deliveries from an outbox, and their Celery tasks.
- ``maintenance``: the reconciler, reaper, aging and expiry tasks, and the beat process.
- ``observability``: Prometheus metrics, structured logs, secret redaction and the audit trail.

``scheduler`` imports neither ``api`` nor ``worker`` (the import-linter contract in pyproject.toml).
Subpackage ``__init__`` modules import nothing: a caller imports the module it needs, so importing a
leaf such as ``scheduler.jobs.error_codes`` stays cheap.
"""
