"""Names of every Redis key the job system uses (Celery's own keys aside), in one place."""

from __future__ import annotations

PREFIX = "cloverq"

# Set while a Celery message for the job is believed to exist; the reconciler re-enqueues
# queued jobs without one (Redis flushed, publish failed, retry due).
ENQUEUED_TTL_SECONDS = 24 * 3600  # a job queued longer gets a (harmless, fenced) duplicate
# Hot status of a job: JSON written by the worker at block boundaries.
PROGRESS_TTL_SECONDS = 24 * 3600
# A cancel signal lives long enough for any worker to notice it.
CANCEL_TTL_SECONDS = 24 * 3600

WORKERS_SET = f"{PREFIX}:workers"

# Where the beat's delayed-job tick left off: "<scheduled_for ISO>|<job id>" of the last delayed
# job it released (scheduler/maintenance/delayed.py); lost with Redis, it restarts a window back.
DELAYED_CURSOR = f"{PREFIX}:delayed:cursor"
# Where the reconciler's scan of due queued rows left off: "<available_at ISO>|<job id>" of the last
# row of a full page (scheduler/maintenance/tasks.py enqueue_due_jobs); gone: it starts over.
RECONCILE_CURSOR = f"{PREFIX}:reconcile:cursor"

# The beat's leader lease (scheduler/infra/leader_lease.py, scheduler/maintenance/beat_leader.py):
# "<fence> <name> <token>" of the beat process that dispatches the periodic tasks, with a TTL; the
# fencing counter (INCR on every acquisition); each beat process's own state, with a TTL, and the
# set naming them (read back by /metrics: cloverq_beat_leader).
BEAT_LEADER_KEY = f"{PREFIX}:beat:leader"
BEAT_FENCE_KEY = f"{PREFIX}:beat:fence"
BEAT_MEMBERS_SET = f"{PREFIX}:beat:members"


def beat_member(name: str) -> str:
    """A beat process's state (JSON: leader or not, fence, tasks dispatched), expiring with it."""
    return f"{PREFIX}:beat:member:{name}"


# Operator state (scheduler/fleet/operator_state.py restores these from SQL after a Redis flush).
DRAINED_SET = f"{PREFIX}:queues:drained"  # set of drained queue names (scheduler/fleet/queue_drain.py)
# hash of runtime limit overrides, field -> number (scheduler/access/admission.py)
LIMITS_KEY = f"{PREFIX}:limits"
REVOKED_SET = f"{PREFIX}:keys:revoked"  # set of revoked API key ids (read by the admission script)

# Admission reservations (scheduler/access/admission.py): sorted sets of enqueued-marker keys, scored by
# expiry (unix ms), of jobs admitted whose message is not in their queue's list yet. The message's
# LPUSH removes them (scheduler/infra/broker.py); one left by a process that died expires.
ADMISSION_RESERVATION_TTL_SECONDS = 60


def enqueued(job_id: object) -> str:
    return f"{PREFIX}:enqueued:{job_id}"


def dead_messages(queue: str) -> str:
    """Sorted set of jobs cancelled while queued whose message is still in ``queue``'s lists
    (members: job ids; scores: expiry in ms). ``queue`` is the Celery queue (a lane included)."""
    return f"{PREFIX}:dead:{queue}"


# Fair share inside a class (scheduler/fairness/): jobs held back from the class's broker list.
# A held job's enqueued marker holds FAIR_HELD_MARKER + its queue instead of a lane name.
FAIR_HELD_MARKER = "held:"


def fair_flows(queue: str) -> str:
    """Set of the flows (``<tenant>/<batch id or ->``) of ``queue`` that hold jobs."""
    return f"{PREFIX}:fair:{queue}:flows"


def fair_flow(queue: str, flow: str) -> str:
    """Sorted set of one flow's held jobs (members ``<job id>|<cost>``; scores: submission order)."""
    return f"{PREFIX}:fair:{queue}:flow:{flow}"


def fair_held(queue: str) -> str:
    """How many jobs ``queue`` holds (an integer; counted in the queue's depth by admission)."""
    return f"{PREFIX}:fair:{queue}:held"


def fair_drr(queue: str) -> str:
    """The deficit round robin's state of ``queue`` (JSON: order, deficits)."""
    return f"{PREFIX}:fair:{queue}:drr"


def fair_lock(queue: str) -> str:
    """Held by the one process releasing ``queue``'s held jobs at a time."""
    return f"{PREFIX}:fair:{queue}:lock"


def fair_again(queue: str) -> str:
    """Set by whoever asks for a release while another process holds the lock: it releases again."""
    return f"{PREFIX}:fair:{queue}:again"


def queue_reservations(queue: str) -> str:
    return f"{PREFIX}:reserved:queue:{queue}"


def rate_bucket(bucket: str) -> str:
    """A token bucket of the rate limit: ``bucket`` is a key id, or ``tenant:<t>`` without keys."""
    return f"{PREFIX}:ratelimit:{bucket}"


def tenant_reservations(tenant: str) -> str:
    return f"{PREFIX}:reserved:tenant:{tenant}"


def tenant_admissions(tenant: str) -> str:
    """How many jobs admission ever admitted for the tenant (a counter; see TenantCountCache)."""
    return f"{PREFIX}:admitted:tenant:{tenant}"


def progress(job_id: object) -> str:
    return f"{PREFIX}:progress:{job_id}"


def events(job_id: object) -> str:
    """A job's live event stream (a Redis stream; ``scheduler/jobs/event_stream.py``)."""
    return f"{PREFIX}:events:{job_id}"


def cancel(job_id: object) -> str:
    return f"{PREFIX}:cancel:{job_id}"


def worker(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


# Pub/sub channel: a job id is published when the job reaches a final status (job_events.py).
JOBS_FINISHED_CHANNEL = f"{PREFIX}:jobs:finished"


def model_switch_turn(model_name: str) -> str:
    """Whose turn it is to switch ``model_name``'s version (worker/model_switch_protocol.py)."""
    return f"{PREFIX}:model:switch-turn:{model_name}"


# Metrics shared by the API, beat and worker processes (scheduler/observability/metrics_recorder.py
# writes, cluster_metrics.py reads).
METRICS_PREFIX = f"{PREFIX}:metrics"
METRICS_WORKERS_SET = f"{METRICS_PREFIX}:workers"  # worker names with a metrics snapshot


def metrics_counter(family: str) -> str:
    """Hash of a counter family: labels field -> value."""
    return f"{METRICS_PREFIX}:c:{family}"


def metrics_histogram(family: str) -> str:
    return f"{METRICS_PREFIX}:h:{family}"


def metrics_worker(worker_name: str) -> str:
    """A worker's latest metrics snapshot (JSON, with a TTL)."""
    return f"{METRICS_PREFIX}:w:{worker_name}"
