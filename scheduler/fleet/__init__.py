"""The serving fleet and the operator's controls over it: the worker registry (``workers``), queue
drains (``drain``), and the operator state kept in SQL and mirrored to Redis (``operator_state``).
"""
