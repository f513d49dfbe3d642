"""Process exit for the Celery-based services (worker, beat)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable


def run_then_exit(main: Callable[[], object]) -> None:
    """Run ``main`` (a Celery ``worker_main``) and leave without interpreter finalisation.

    Celery has finished its clean shutdown when ``worker_main`` returns or raises SystemExit (jobs
    drained, engine stopped, registry left); tearing down torch and idle pool threads at
    interpreter exit only adds seconds to every stop and restart.
    """
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    else:
        code = 0
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
