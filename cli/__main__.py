"""``python -m cli ...`` runs the ``cloverq`` command (used by ``cloverq up`` for its children)."""

from cli.main import main

main()
