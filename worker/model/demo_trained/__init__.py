"""The shipped, trained demo checkpoints (data, not code): ``clover/`` is what ``cloverq up`` serves.

Made by ``cloverq model train-demo`` (``worker.training``); its ``README.md`` gives the command,
seed, time and loss. The random ``cloverq model init-demo`` checkpoints stay for shape and parity
tests; this one answers the corpus's questions.
"""

from __future__ import annotations

from pathlib import Path

TRAINED_CLOVER_DEMO = Path(__file__).resolve().parent / "clover"
