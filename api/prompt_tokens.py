"""Counting prompt tokens in the API without ever loading a model.

When the checkpoint's ``tokenizer.json`` is on this machine (the embedded default, or a shared
model volume) the API loads it ONCE at start-up with the ``tokenizers`` library (milliseconds,
no torch) and counts exactly. Otherwise it falls back to a conservative bound: the checkpoints
cloverq serves use byte-level BPE, where every token covers at least one UTF-8 byte, so a text
never has more tokens than bytes. The fallback therefore never admits an over-long prompt, but
may refuse a long prompt that would have fit; deployments that split API and workers should
mount the tokenizer (``CLOVERQ_MODEL_DIR``) for exact counting. Either way the count excludes
the chat template's few framing tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import structlog
from tokenizers import Tokenizer

log = structlog.get_logger(__name__)


class PromptTokenCounter:
    """Counts (or bounds from above) the tokens of user-supplied text."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer

    @property
    def exact(self) -> bool:
        """True when counts come from the real tokenizer, False for the byte bound."""
        return self._tokenizer is not None

    @classmethod
    def from_model_dir(cls, model_dir: Path | None) -> PromptTokenCounter:
        """Load ``tokenizer.json`` from ``model_dir`` if present, else use the byte bound."""
        path = (model_dir / "tokenizer.json") if model_dir is not None else None
        if path is None or not path.is_file():
            log.info("prompt_tokens_byte_bound", reason="no tokenizer.json", model_dir=str(model_dir))
            return cls(None)
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # a broken tokenizer file must not stop the API
            log.warning("prompt_tokens_byte_bound", reason="tokenizer failed to load", error=str(exc))
            return cls(None)

    def count(self, texts: Sequence[str]) -> int:
        """Tokens in ``texts`` (exact), or their UTF-8 byte count (an upper bound)."""
        if self._tokenizer is None:
            return sum(len(text.encode("utf-8")) for text in texts)
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return sum(len(encoding.ids) for encoding in encodings)
