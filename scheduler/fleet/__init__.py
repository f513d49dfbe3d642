"""The serving fleet and the operator's controls over it: the worker registry (``workers``), queue
drains (``drain``), the operator state kept in SQL and mirrored to Redis (``operator_state``), and
what a worker can hold of a long sequence (``sequence_memory``, ``checkpoint_context``,
``context_limits``).
"""
