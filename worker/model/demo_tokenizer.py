"""The demo checkpoint's tokenizer: byte-level BPE trained deterministically on a built-in corpus.

The merges are learned here in plain Python (highest pair count first, ties broken by the pair's
text) instead of with ``tokenizers``' trainer, whose tie-breaking may depend on hash order; the
result is then packaged as an ordinary ``tokenizers`` byte-level BPE, so the same seed and size
always give a byte-identical ``tokenizer.json``.
"""

from __future__ import annotations

import itertools
from collections import Counter

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END, MASK, PAD = "<think>", "</think>", "<|mask|>", "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END, MASK, PAD)

# Qwen3's chat template semantics: earlier assistant turns lose their reasoning; with
# enable_thinking=false the generation prompt carries an empty think block. With ``tools`` (as
# Hugging Face's apply_chat_template passes them: [{"type": "function", "function": {...}}]) the
# system turn gains a tools section, assistant tool_calls render in the Qwen3 XML call format
# (Qwen3-Coder / Qwen3.5: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n
# </function>\n</tool_call>; string values raw, others JSON) and tool results as <tool_response>
# blocks in one user turn. Without tools and tool turns it renders exactly as before.
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "{{- messages[0]['content'] + '\\n\\n' }}\n"
    "{%- endif %}\n"
    "{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}\n"
    "{%- for tool in tools %}\n"
    "{{- '\\n' + (tool | tojson) }}\n"
    "{%- endfor %}\n"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\n"
    "value_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if tools and loop.first and message['role'] == 'system' %}\n"
    "{%- elif message['role'] == 'assistant' %}\n"
    "{%- set content = message['content'] %}\n"
    "{%- if '</think>' in content %}\n"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>assistant\\n' + content }}\n"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}\n"
    "{%- for tool_call in message['tool_calls'] %}\n"
    "{%- if tool_call['function'] is defined %}\n"
    "{%- set tool_call = tool_call['function'] %}\n"
    "{%- endif %}\n"
    "{%- if not loop.first %}\n"
    "{{- '\\n' }}\n"
    "{%- elif content | trim %}\n"
    "{{- '\\n\\n' }}\n"
    "{%- endif %}\n"
    "{{- '<tool_call>\\n<function=' + tool_call['name'] + '>\\n' }}\n"
    "{%- if tool_call['arguments'] is mapping %}\n"
    "{%- for name, value in tool_call['arguments'] | items %}\n"
    "{{- '<parameter=' + name + '>\\n' }}\n"
    "{%- if value is string %}\n"
    "{{- value }}\n"
    "{%- else %}\n"
    "{{- value | tojson }}\n"
    "{%- endif %}\n"
    "{{- '\\n</parameter>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '</function>\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message['role'] == 'tool' %}\n"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}\n"
    "{{- '<|im_start|>user' }}\n"
    "{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}\n"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A clover has three leaves, and a lucky one has four.
Block diffusion models write text one block at a time: every position of a block starts as a mask
and is filled in over a few denoising steps, the most confident tokens first.
A mixture of experts routes every token to a few of many small feed-forward networks, so a model
with many parameters only spends the compute of a small one on each token.
The scheduler sends short requests first, but nobody starves: long work ages up over time.
Jobs are submitted, queued, claimed by a worker, run, and then they succeed, fail or are cancelled.
Question: What is the capital of France? Answer: Paris is the capital of France.
Question: How many legs does a spider have? Answer: A spider has eight legs.
Question: Is the sky blue? Answer: Yes, on a clear day the sky is blue.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
{"name": "clover", "leaves": 3, "lucky": false, "tags": ["plant", "green"]}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 100 128 256 512 1000 1024 2048 4096.
The weather today is sunny with a light breeze, and tomorrow there may be rain in the afternoon.
She opened the window, looked at the garden, and smiled at the small green leaves after the rain.
Please summarise the following text in one sentence and then list three key points.
Let me think step by step. First, read the question. Then, find the facts. Finally, answer.
The system of record is the database; the message broker only carries job ids to the workers.
A worker holds one resident model and batches the jobs it runs at block boundaries.
yes no maybe true false none null positive negative neutral red green blue yellow
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June
"""


def _train_merges(words: Counter[str], alphabet: list[str], max_vocab: int) -> tuple[dict[str, int], list]:
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    pieces = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(vocab) < max_vocab:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            seq = pieces[word]
            for pair in itertools.pairwise(seq):
                pairs[pair] += count
        if not pairs:
            break
        best, count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < 2:
            break
        merged = best[0] + best[1]
        merges.append(best)
        vocab[merged] = len(vocab)
        for word, seq in pieces.items():
            if len(seq) < 2:
                continue
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == best[0] and seq[i + 1] == best[1]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            pieces[word] = out
    return vocab, merges


def build_demo_tokenizer(total_vocab: int) -> HFTokenizer:
    """A byte-level BPE tokenizer with ``total_vocab`` ids at most (special tokens last)."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words: Counter[str] = Counter()
    for line in CORPUS.splitlines(keepends=True):
        words.update(piece for piece, _ in pre.pre_tokenize_str(line))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges = _train_merges(words, alphabet, total_vocab - len(SPECIAL_TOKENS))
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer
