"""Webhooks: the signed outbox deliveries (``delivery``) and their Celery tasks (``tasks``)."""
