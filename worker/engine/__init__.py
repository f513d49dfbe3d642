"""The continuous-batching engine (plain torch; no Celery, SQL or HTTP).

``engine.Engine`` owns the model and the device on one thread; callers ``submit`` a
``types.GenerationRequest`` and get a ``concurrent.futures.Future[GenerationResult]``.
Invalid requests resolve at once with ``finish_reason=ERROR`` and ``error`` set (not retryable);
faults while running the model set an exception on the future (retryable). This package's
``__init__`` imports nothing, so ``worker.engine.types`` stays importable without torch.
"""
