"""The trained demo's tokenizer: byte-level BPE learned with ``tokenizers`` on the training split.

The texts are the corpus's rows as the engine sees them (decision prompts with their JSON answers,
generation chats with their targets), rendered with a provisional tokenizer (the random demo's)
and decoded back to text without the special tokens. The special tokens are added after training,
with the ids last, as the random demo has them (``worker.model.demo_tokenizer``), so the mask,
pad, chat and think markers are single ids whatever the merges are.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from worker.model.demo import CHAT_TEMPLATE
from worker.model.demo_tokenizer import IM_END, MASK, PAD, SPECIAL_TOKENS, build_demo_tokenizer
from worker.model.tokenizer import Tokenizer
from worker.training.corpus import Split, decision_cases, generation_cases, tool_call_cases
from worker.training.rows import MODES, decision_rows, generation_row, tool_call_row

TOKENIZER_CASES = 400  # of each kind: ~1 MB of text, enough for 500 ids
# The tool-call format's tags (worker/structured/tool_render.py), one id each in a tokenizer that
# learned the tool chats (as Qwen's own tokenizer has ``<tool_call>``): byte-level BPE splits each
# into 3-5 pieces, so a call of one argument was 35 tokens of which 3 say what to call.
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")


def wrap(backend: HFTokenizer) -> Tokenizer:
    """The project's ``Tokenizer`` over a demo-layout backend (the demo's chat template)."""
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        token_id = backend.token_to_id(t)
        if token_id is None:
            raise RuntimeError(f"the tokenizer lacks {t!r}")
        ids[t] = token_id
    return Tokenizer(backend, chat_template=CHAT_TEMPLATE, mask_token_id=ids[MASK],
                     eos_token_ids=(ids[IM_END],), pad_token_id=ids[PAD])  # fmt: skip


def corpus_texts(
    seed: int, cases: int = TOKENIZER_CASES, headings: bool = False, tools: bool = False,
    split: Split = "train",
) -> Iterator[str]:
    provisional = wrap(build_demo_tokenizer(512))
    for case in decision_cases(split, seed, cases, headings=headings):
        for mode in MODES:
            for row in decision_rows(case, mode, provisional, block=1):
                yield provisional.decode(list(row.ids), skip_special_tokens=True)
    for gen in generation_cases(split, seed, cases, headings=headings):
        yield provisional.decode(
            list(generation_row(gen, provisional, block=1).ids), skip_special_tokens=True
        )
    if tools:  # only for a run with tool-call rows: the shipped recipe's tokenizer stays as it was
        for chat in tool_call_cases(split, seed, cases, headings=headings):
            row = tool_call_row(chat, provisional, block=1)
            yield provisional.decode(list(row.ids), skip_special_tokens=True)


def train_tokenizer(
    seed: int, total_vocab: int = 512, cases: int = TOKENIZER_CASES, headings: bool = False,
    tools: bool = False, split: Split = "train",
) -> HFTokenizer:
    """A byte-level BPE of at most ``total_vocab`` ids (special tokens last) learned on the corpus
    (``headings``: the headed corpus, ``worker.training.corpus.decision_case``; ``tools``: its
    tool-call chats too, ``worker.training.tool_calls``, and ``TOOL_TAGS`` one id each on top of
    ``total_vocab``; ``split``: the training split it reads, ``train_wide`` for a run with more
    phrasings)."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=total_vocab - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts(seed, cases, headings, tools, split), trainer=trainer)
    if tools:  # plain added tokens (decoded as text, so the call parser reads them), before the specials
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer
