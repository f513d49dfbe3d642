"""Tensor parallelism: one model split across N ranks (devices) of one worker.

- ``plan``: which heads / channels / columns / experts rank ``r`` of ``N`` holds, and the config
  whose model has exactly those shapes;
- ``shard``: that rank's model (the family's own classes plus two all-reduce hooks per layer) and
  its weights, read as slices of the memory-mapped checkpoint;
- ``sources``: where a rank's weights come from (a checkpoint folder; a benchmark's random
  weights), and the one way every rank builds its shard from a source;
- ``quant``: ``CLOVERQ_WEIGHT_DTYPE`` per rank: each quantizes its shard with the one-device rules
  (row-parallel int8 scales from the whole rows, one all-reduce at load);
- ``launch``: ``load_tensor_parallel`` / ``launch``: rank 0 starts ranks 1..N-1, builds its own
  shard and joins them in one ``torch.distributed`` group;
- ``spawn``: ranks 1..N-1 as fresh interpreters joined to rank 0 by a pipe (``rank.py`` is their
  ``__main__``), and the ``RankSpec`` each receives first;
- ``pipe_codec``: the messages on those pipes (pickled, tensors as numpy arrays);
- ``proxies``: rank 0's stand-ins for the model and its cache, which replay every forward and
  cache operation on ranks 1..N-1 (``RankGroup``, ``TensorParallelModel``, ``TensorParallelCache``);
- ``rank_server``: what ranks 1..N-1 run: load, join, then execute rank 0's messages in order;
- ``errors``: ``TensorParallelError`` and the errors that leave the ranks in step.

What is split: attention query heads with their K/V heads (replicated when there are fewer K/V
heads than ranks), GDN value heads with the key heads they read and everything per head or per
channel of them (``in_proj_qkv`` rows, conv taps left and right, ``in_proj_z/a/b``, ``A_log``,
``dt_bias``, the preview's ``bd_*`` vectors); ``o_proj`` / ``out_proj`` are row-split and one
all-reduce per mixer sums them. Dense and shared-expert MLPs go column-then-row, the routed
experts too; the routed and shared outputs of a layer share its one feed-forward all-reduce.
Embedding, norms and routers are replicated (every rank routes every token alike); the LM head
lives on rank 0 only, which samples. Supported: the sdar and clover families.

**Experts: split by columns, not by experts** (``moe="columns"``, the default; ``"experts"`` is
kept as an option and benchmarked by ``python -m bench.tp``). Measured on CPU, one MoE layer of
the small demos (32 experts, top-4), the slowest of 2 ranks, one thread each (ms):

    rows          TP=1    columns (slowest rank)   experts (slowest rank)
    Clover    4    3.34    2.25                     2.44 (ranks 1.53 / 2.44)
    Clover   64   11.72    6.40                     6.34
    Clover  512   34.11   19.45                    17.65
    SDAR      4    2.76    1.97                     1.61
    SDAR     64   10.21    6.73                     6.91
    SDAR    512   30.03   18.51                    16.50

(A second run, under heavier background load, gave the same pattern.) Compute alone is a wash:
within ~10% either way, whole experts winning a little at prefill sizes, where GEMMs are wide.
What decides is the regime that sets latency, a decode pass of a few tokens per row, which is
memory-bound: with columns every rank reads exactly ``1/N`` of each routed expert, while with
experts the busiest rank waits on its share of the hit experts, 1.16 to 1.27 times the mean at
batch 1 in the same runs (1.05 to 1.09 at batch 16), and the all-reduce waits for the busiest
rank. Expert parallelism also costs a host sync per MoE layer here (where the rank's token
copies lie), which stalls a CUDA launch queue, and re-implements the dispatch, where the column
split runs the family's own MoE module unchanged (whatever its router).
"""

from __future__ import annotations
