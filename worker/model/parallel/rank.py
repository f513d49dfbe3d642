"""``python -m worker.model.parallel.rank FD PID``: one of ranks 1..N-1 (started by ``spawn.spawn_rank``)."""

from __future__ import annotations

import sys

from worker.model.parallel.rank_server import rank_main

if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]))
