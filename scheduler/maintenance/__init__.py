"""Recovery and housekeeping: the reconciler, reaper, aging and expiry tasks (``tasks``) and the
light beat process that runs them (``beat``).
"""
