"""Counting prompt tokens in the API without ever loading a model.

When the checkpoint's ``tokenizer.json`` is on this machine (the embedded default, or a shared
model volume) the API loads it ONCE at start-up with the ``tokenizers`` library (milliseconds,
no torch) and counts exactly. Otherwise it falls back to a conservative bound: the checkpoints
cloverq serves use byte-level BPE, where every token covers at least one UTF-8 byte, so a text
never has more tokens than bytes. The fallback therefore never admits an over-long prompt, but
may refuse a long prompt that would have fit; deployments that split API and workers should
mount the tokenizer (``CLOVERQ_MODEL_DIR``) for exact counting. Either way the count excludes
the chat template's few framing tokens.

The same folder's ``config.json`` gives the checkpoint's context (``checkpoint``: its
``max_position_embeddings`` and what one sequence holds, ``scheduler.fleet.checkpoint_context``),
read once with the tokenizer, so the API judges a long prompt by the checkpoint the tokens were
counted for (issue 26); None without one (the operator's limits alone then).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import structlog
from tokenizers import Tokenizer

from scheduler.fleet.checkpoint_context import CheckpointContext, read_checkpoint_context

log = structlog.get_logger(__name__)


class PromptTokenCounter:
    """Counts (or bounds from above) the tokens of user-supplied text, for the checkpoint whose
    context (``checkpoint``) the API knows, if any."""

    def __init__(self, tokenizer: Tokenizer | None, checkpoint: CheckpointContext | None = None,
                 *, memo: dict[str, int] | None = None) -> None:
        self._tokenizer = tokenizer
        self.checkpoint = checkpoint
        self._memo = memo  # per text, for one request (for_request); None: count every time

    def for_request(self) -> PromptTokenCounter:
        """A counter for one request (or one batch): each distinct text is tokenized once, though
        the limit checks and the routing cost both count it (a 16K-token contract once, not twice)."""
        return PromptTokenCounter(self._tokenizer, self.checkpoint, memo={})

    @property
    def exact(self) -> bool:
        """True when counts come from the real tokenizer, False for the byte bound."""
        return self._tokenizer is not None

    @classmethod
    def from_model_dir(cls, model_dir: Path | None, *, dtype: str | None = None) -> PromptTokenCounter:
        """Load ``tokenizer.json`` from ``model_dir`` if present, else use the byte bound; and the
        checkpoint's context from its ``config.json`` (``dtype``: ``CLOVERQ_DTYPE``)."""
        checkpoint = read_checkpoint_context(model_dir, dtype=dtype) if model_dir is not None else None
        log.info("prompt_context", model_dir=str(model_dir),
                 max_positions=checkpoint.max_positions if checkpoint is not None else None)
        path = (model_dir / "tokenizer.json") if model_dir is not None else None
        if path is None or not path.is_file():
            log.info("prompt_tokens_byte_bound", reason="no tokenizer.json", model_dir=str(model_dir))
            return cls(None, checkpoint)
        try:
            return cls(Tokenizer.from_file(str(path)), checkpoint)
        except Exception as exc:  # a broken tokenizer file must not stop the API
            log.warning("prompt_tokens_byte_bound", reason="tokenizer failed to load", error=str(exc))
            return cls(None, checkpoint)

    def count(self, texts: Sequence[str]) -> int:
        """Tokens in ``texts`` (exact), or their UTF-8 byte count (an upper bound)."""
        if self._memo is None:
            return sum(self._counts(texts))
        missing = [text for text in dict.fromkeys(texts) if text not in self._memo]
        self._memo.update(zip(missing, self._counts(missing), strict=True))
        return sum(self._memo[text] for text in texts)

    def _counts(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text (its UTF-8 bytes without a tokenizer)."""
        if not texts:
            return []
        if self._tokenizer is None:
            return [len(text.encode("utf-8")) for text in texts]
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [len(encoding.ids) for encoding in encodings]
