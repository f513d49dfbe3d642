"""The checkpoint's tokenizer (``tokenizer.json``) and its chat template.

The chat template is read from the first of ``chat_template.jinja`` (what recent transformers'
``save_pretrained`` writes), ``chat_template.json`` (``{"chat_template": ...}``) and the
``chat_template`` entry of ``tokenizer_config.json`` (older checkpoints), as transformers does.

Special-token ids (mask, EOS, pad, ``<think>``) are resolved once from the files a published
checkpoint ships (config.json, generation_config.json, tokenizer_config.json, tokenizer.json), so
the engine never hard-codes an id. The chat template is rendered with Jinja in a sandbox, the way
Hugging Face renders it, with Qwen3's ``enable_thinking`` switch passed through.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

MASK_TOKEN_CANDIDATES: tuple[str, ...] = ("<|mask|>", "<|MASK|>", "<mask>", "[MASK]")
THINK_START, THINK_END = "<think>", "</think>"


class TokenizerError(RuntimeError):
    """The tokenizer files are missing or inconsistent."""


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as ``{"content": ...}`` dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


CHAT_TEMPLATE_FILES: tuple[str, ...] = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def _template_text(value: Any) -> str | None:
    """A template given as text, or as ``[{"name": "default", "template": ...}, ...]``."""
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"),
                     None)
    return value if isinstance(value, str) and value.strip() else None


def find_chat_template(folder: Path, tok_cfg: dict[str, Any] | None = None) -> str | None:
    """The chat template of a checkpoint folder (first of ``CHAT_TEMPLATE_FILES``), or None."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file() and jinja_file.read_text().strip():
        return jinja_file.read_text()
    try:
        from_json = _template_text(_read_json(folder / "chat_template.json").get("chat_template"))
    except ValueError as exc:
        raise TokenizerError(f"{folder / 'chat_template.json'} is not valid JSON: {exc}") from exc
    if from_json is not None:
        return from_json
    if tok_cfg is None:
        tok_cfg = _read_json(folder / "tokenizer_config.json")
    return _template_text(tok_cfg.get("chat_template"))


class Tokenizer:
    """Text <-> ids plus the chat template and the special ids the engine needs."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        chat_template: str | None,
        mask_token_id: int,
        eos_token_ids: tuple[int, ...],
        pad_token_id: int,
        vocab_size: int | None = None,
    ) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.mask_token_id = mask_token_id
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self.think_start_id = self.token_id(THINK_START)
        self.think_end_id = self.token_id(THINK_END)

    @staticmethod
    def find_mask_token_id(tokenizer_json: Path, candidates: tuple[str, ...] | None = None) -> int | None:
        """The first of ``candidates`` (default: every family's) that the tokenizer knows."""
        backend = _HFTokenizer.from_file(str(tokenizer_json))
        for text in candidates or MASK_TOKEN_CANDIDATES:
            token = backend.token_to_id(text)
            if token is not None:
                return token
        return None

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        """Read ``tokenizer.json`` and the config files of a checkpoint folder."""
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"tokenizer.json is missing from {folder}")
        backend = _HFTokenizer.from_file(str(file))
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        model_cfg = _read_json(folder / "config.json")
        gen_cfg = _read_json(folder / "generation_config.json")

        def lookup(text: str | None) -> int | None:
            return backend.token_to_id(text) if text else None

        mask = model_cfg.get("mask_token_id")
        if mask is None:
            mask = lookup(_token_text(tok_cfg.get("mask_token"))) or cls.find_mask_token_id(file)
        if mask is None:
            raise TokenizerError(f"no mask token in {folder} (config mask_token_id or a <|mask|> token)")
        eos_from_tok = lookup(_token_text(tok_cfg.get("eos_token")))
        eos = tuple(
            dict.fromkeys(
                (
                    *_ids(gen_cfg.get("eos_token_id")),
                    *_ids(model_cfg.get("eos_token_id")),
                    *(() if eos_from_tok is None else (eos_from_tok,)),
                )
            )
        )
        if not eos:
            raise TokenizerError(f"no EOS token id in {folder}")
        pad = lookup(_token_text(tok_cfg.get("pad_token")))
        if pad is None:
            pad = gen_cfg.get("pad_token_id", model_cfg.get("pad_token_id"))
        return cls(
            backend,
            chat_template=find_chat_template(folder, tok_cfg),
            mask_token_id=int(mask),
            eos_token_ids=eos,
            pad_token_id=int(pad if pad is not None else eos[0]),
        )

    # --- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special-token strings in it become their ids (chat markup)."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_spans(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` (as ``encode``) and each one's (start, end) characters in ``text``."""
        encoding = self._backend.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(span) for span in encoding.offsets]  # type: ignore[misc]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        """Id of one token given its text, or None."""
        return self._backend.token_to_id(text)

    # --- chat -----------------------------------------------------------------------------------
    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise TokenizerError(
                "this checkpoint has no chat template (none of " + ", ".join(CHAT_TEMPLATE_FILES) + ")"
            )
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        enable_thinking: bool,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}]``).

        ``tools`` go to the template as Hugging Face's ``apply_chat_template(tools=...)`` passes
        them (``[{"type": "function", "function": {...}}]``; none: the variable is left
        undefined, as there). Assistant ``tool_calls`` must carry ``arguments`` as a mapping, the
        form templates iterate (``worker/structured/tool_render.py`` converts OpenAI's text)."""
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        return self._template.render(
            messages=messages,
            enable_thinking=enable_thinking,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
