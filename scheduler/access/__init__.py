"""Who may call and how much: API keys (``api_keys``) and admission control (``admission``)."""
