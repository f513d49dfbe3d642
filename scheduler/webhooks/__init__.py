"""Webhooks: a signed POST when a job (or a whole batch) finishes, starts or progresses.

- ``tables``: the outbox (``webhook_deliveries``) and the tenants' secrets (``webhook_secrets``);
- ``outbox``: the rows a finished job or batch inserts (``job_events``: started / progress), and
  the overdue ones the sweeper publishes again;
- ``signing``: the per-tenant secret and the ``X-Cloverq-Signature`` header (and its check);
- ``ssrf_guard``: which URLs and addresses a webhook may go to, checked at submit and delivery;
- ``delivery``: one attempt of a delivery (check, sign, POST, record) and its retry backoff;
- ``events``: which events a job asked for; ``progress``: the progress throttle;
- ``tasks``: the Celery tasks (deliver, sweep) and the publishing of delivery ids.
"""
