"""Block-diffusion decoding rules (docs/architecture.md §3.7): step quotas and
budget planning (``schedule``), token selection (``selection``), static/dynamic commit rules
(``commit``), the generated region and infill constraints (``layout``) and the per-request state
machine (``sequence``). The engine batches them; nothing here decides who runs when.
"""
