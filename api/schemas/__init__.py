"""Request and response models of the HTTP API (separate from the SQL table models)."""
