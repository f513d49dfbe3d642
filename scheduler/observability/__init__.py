"""How cloverq is watched: Prometheus metrics, JSON logs, secret redaction and the audit trail."""
