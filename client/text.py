"""Rebuilding a job's answer from its ``delta`` events (shared by both clients)."""

from __future__ import annotations

from client.models import JobEvent


class TextAssembler:
    """Feed the events of one job; get the new text of its answer after each.

    A ``delta`` says ``text = text[:offset] + delta`` (the worker's view, which may correct a
    character split across blocks); what was handed out already is never taken back, so the
    pieces handed out join to the final ``result.text`` (the rest comes with the ``result``).
    A new attempt (a retry) starts its text again; pieces continue after what was handed out.
    """

    def __init__(self) -> None:
        self.text = ""
        self.handed_out = 0
        self.attempt: int | None = None

    def feed(self, event: JobEvent) -> str:
        if event.event == "delta":
            attempt = event.data.get("attempt")
            if attempt != self.attempt:
                self.attempt, self.text = attempt, ""
            offset = event.data.get("offset")
            piece = event.data.get("text")
            if isinstance(offset, int) and isinstance(piece, str):
                self.text = self.text[: max(0, offset)] + piece
            return self._take(self.text)
        if event.event == "result":
            job = event.job
            return self._take((job.text or "") if job is not None else "")
        return ""

    def _take(self, text: str) -> str:
        if len(text) <= self.handed_out:
            return ""
        piece = text[self.handed_out:]
        self.handed_out = len(text)
        return piece
