"""Structured output valid by construction: JSON Schema -> canvas (fixed tokens + constrained
slots) -> engine infill -> the value, for ``response_format``, named tool calls and ``extract``.

Plain Python/torch (no Celery, SQL or HTTP). The slot rules are written down in
``docs/structured.md``; the per-position rule that needs the sampler (pads only as a tail) lives
in ``worker/sampler/pad_tail.py``.
"""
