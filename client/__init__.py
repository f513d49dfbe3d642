"""cloverq's Python client: typed, sync (:class:`Client`) and asyncio (:class:`AsyncClient`), on httpx.

It speaks the job API (``/v1/jobs``, ``/v1/jobs/{id}/events``, ``/v1/batches``) and nothing
else: no import of the service's packages, so it works from any machine that can reach the API.
The ``cloverq`` CLI's client commands are built on it. For OpenAI-shaped calls use the ``openai``
package against ``/v1`` (or ``/openai/v1`` for its Batch API).

    from client import Client

    with Client("http://127.0.0.1:8000", api_key="cloverq_...") as cq:
        job = cq.submit("Write a haiku about queues.", max_new_tokens=32)
        for piece in cq.stream_text(job.id):      # one piece per committed block
            print(piece, end="", flush=True)
        done = cq.wait(job.id)                     # long polling
        decision = cq.wait(cq.decide("A short text.", [{"id": "q", "text": "Is it short?"}]).id)
        fields = cq.wait(cq.extract("Acme Corp sells to Bolt Ltd.", {
            "type": "object", "properties": {"seller": {"type": "string", "maxLength": 20}}}).id).data
"""

from client._core import DEFAULT_BASE_URL, CloverqError, JobTimeout, RetryPolicy, retry_after
from client.aio import AsyncClient
from client.models import Batch, Job, JobError, JobEvent, JobPage, JobProgress, JobResult, JobTimings
from client.sync import Client
from client.text import TextAssembler

__all__ = [
    "DEFAULT_BASE_URL",
    "AsyncClient",
    "Batch",
    "Client",
    "CloverqError",
    "Job",
    "JobError",
    "JobEvent",
    "JobPage",
    "JobProgress",
    "JobResult",
    "JobTimeout",
    "JobTimings",
    "RetryPolicy",
    "TextAssembler",
    "retry_after",
]
