"""The job and its life: the ``jobs`` table, submit / read / cancel, routing, publishing, fenced
transitions, retry policy, error codes, the finished notice (pub/sub) and the event stream.
"""
