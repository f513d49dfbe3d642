"""Which model version serves: the registry and active version (``registry``) and canary releases
(``canary``: state; ``canary_routing``: which version a job goes to; ``canary_gate``: promotion;
``canary_reconcile``: the reconciler's part).
"""
