"""Tensor parallelism on CPU with gloo: two real ranks (this process + one spawned) vs the plain model.

Both families' tiny demo checkpoints split two ways (Clover: 4 query / 2 K/V heads, 2 GDN key /
4 value heads, 8 experts + a shared expert; SDAR: 4 / 2 heads, 8 experts, one dense layer).

Tolerance: fp32 logits agree to ``1e-5 * max(1, max |logit|)``. SDAR's stay within 1e-5 absolute;
Clover's reach ~2.5e-5 absolute on logits of ~7.5 (3e-6 relative): the all-reduce sums the
partial products in another order (~1e-6 on hidden states) and the demo's second GDN layer
amplifies any input change ~20x (as much as TP=1 fp32 differs from the same model in fp64).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from worker.engine.engine import Engine, EngineConfig
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import LoadedModel, load_checkpoint, read_config, weight_files
from worker.model.parallel.launch import close_active, load_tensor_parallel
from worker.model.parallel.plan import ShardError, make_plan, rank_config
from worker.model.parallel.proxies import TensorParallelModel
from worker.model.parallel.shard import build_shard, load_shard_weights


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    tolerance = 1e-5 * max(1.0, a.abs().max().item())
    assert (a - b).abs().max().item() <= tolerance, ((a - b).abs().max().item(), tolerance)


# --- the plan and the slices (no processes) --------------------------------------------------------


def test_plan_splits_heads_and_replicates_kv_heads_when_fewer_than_ranks(demo_checkpoint: Path) -> None:
    config = read_config(demo_checkpoint)
    p0, p1 = make_plan(config, 0, 2), make_plan(config, 1, 2)
    assert (p0.q_heads, p1.q_heads, p0.kv_heads, p1.kv_heads) == (range(0, 2), range(2, 4), range(0, 1),
                                                                  range(1, 2))
    assert (p0.k_heads, p1.k_heads, p0.v_heads, p1.v_heads) == (range(0, 1), range(1, 2), range(0, 2),
                                                                range(2, 4))
    assert p0.moe_cols == range(0, 16) and p0.experts == range(8)
    assert make_plan(config, 1, 2, "experts").experts == range(4, 8)
    shard = rank_config(config, p1)
    assert (shard.num_attention_heads, shard.num_key_value_heads, shard.linear_num_value_heads) == (2, 1, 2)
    # 4 ranks: one query head each, the 2 K/V heads (and 2 GDN key heads) replicated in pairs
    assert [make_plan(config, r, 4).kv_heads for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [make_plan(config, r, 4).k_heads for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    with pytest.raises(ShardError, match="num_attention_heads=4"):
        make_plan(config, 0, 3)


def test_llada2_is_refused_with_the_reason(tmp_path: Path) -> None:
    """Issue 30: LLaDA2 stays refused (its fused query_key_value has no per-rank slicing); the message
    says why and what to do, before any rank starts."""
    from worker.model.demo import write_demo_checkpoint

    config = read_config(write_demo_checkpoint(tmp_path / "llada2", seed=3, arch="llada2"))
    with pytest.raises(ShardError, match=r"not llada2: .*query_key_value.*CLOVERQ_TENSOR_PARALLEL=1"):
        make_plan(config, 0, 2)


@pytest.mark.parametrize("moe", ["columns", "experts"])
@pytest.mark.parametrize("arch", ["clover", "sdar"])
def test_each_rank_reads_only_its_slices(arch: str, moe: str, demo_checkpoint: Path,
                                         sdar_checkpoint: Path) -> None:
    """Every element of a rank's parameters is read once from the checkpoint and nothing more: the
    split tensors are read as slices, never whole; the slices of both ranks make the whole."""
    path = demo_checkpoint if arch == "clover" else sdar_checkpoint
    config = read_config(path)
    files = weight_files(path)
    full = load_checkpoint(path, verify=False).model
    full_params = dict(full.named_parameters())
    shards = []
    for rank in range(2):
        shard = build_shard(config, make_plan(config, rank, 2, moe), device="cpu", dtype=torch.float32,
                            reduce=lambda t: None)
        read = load_shard_weights(shard, files, config)
        held = sum(p.numel() for p in shard.model.parameters())
        assert read == held < sum(p.numel() for p in full_params.values())
        shards.append(dict(shard.model.named_parameters()))
    name = "layers.1.mixer.o_proj.weight" if config.family == "clover" else "layers.1.attn.o_proj.weight"
    torch.testing.assert_close(torch.cat([s[name] for s in shards], dim=1), full_params[name], rtol=0, atol=0)
    experts = "layers.1.mlp.w_down"
    dim = 0 if moe == "experts" else 1  # [E, I, H]: experts whole per rank, or intermediate rows
    torch.testing.assert_close(torch.cat([s[experts] for s in shards], dim=dim), full_params[experts],
                               rtol=0, atol=0)
    assert "lm_head.weight" in shards[0] and "lm_head.weight" not in shards[1]  # only rank 0 samples


# --- two real ranks --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["clover/columns", "sdar/columns", "clover/experts"])
def pair(request: pytest.FixtureRequest, demo_checkpoint: Path,
         sdar_checkpoint: Path) -> Iterator[tuple[LoadedModel, TensorParallelModel]]:
    """The plain model and a 2-rank one of the same checkpoint (one group at a time per process)."""
    arch, moe = request.param.split("/")
    path = demo_checkpoint if arch == "clover" else sdar_checkpoint
    plain = load_checkpoint(path)
    sharded = load_tensor_parallel(path, world=2, moe=moe, threads=1, verify=False)
    yield plain, sharded.model  # type: ignore[misc]
    close_active()


def test_tp2_logits_equal_tp1_with_and_without_cache(pair: tuple[LoadedModel, TensorParallelModel]) -> None:
    plain, tp = pair
    model = plain.model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, plain.config.vocab_size, (2, 12), generator=gen)
    pos = torch.arange(12).expand(2, -1)
    _close(model(ids, pos, pos // 4), tp(ids, pos, pos // 4))
    caches = [m.new_cache(max_seqs=3, max_len=64, device="cpu", dtype=torch.float32) for m in (model, tp)]
    slots = [torch.tensor([c.allocate(), c.allocate()]) for c in caches]
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 10:] = False  # a padded row
    calls = [  # prefill (commits 8 and 4 tokens), a fused commit + preview pass, a pure preview
        dict(input_ids=ids, positions=pos, block_ids=pos // 4, valid=valid, commit_lens=torch.tensor([8, 4])),
        dict(input_ids=ids[:, :8], positions=pos[:, :8] + 8, block_ids=(pos[:, :8] + 8) // 4,
             commit_lens=torch.tensor([4, 4]), logits_index=torch.arange(4, 8).expand(2, -1)),
        dict(input_ids=ids[:, :4], positions=pos[:, :4] + 12, block_ids=(pos[:, :4] + 12) // 4,
             commit_lens=torch.tensor([0, 0])),
    ]
    for call in calls:
        want = model(**call, cache=caches[0], slots=slots[0])
        got = tp(**call, cache=caches[1], slots=slots[1])
        assert got.shape == want.shape
        _close(want, got)
    assert caches[0].lengths.tolist() == caches[1].lengths.tolist() == [12, 8, 0]


def test_greedy_tokens_identical_through_the_engine(pair: tuple[LoadedModel, TensorParallelModel]) -> None:
    plain, tp = pair
    results = []
    cfg = plain.config
    requests = [("The quick brown fox", 4, "static"), ("Hello", 2, "dynamic"), ("a b c d e f g", 1, "static")]
    for model in (plain.model, tp):
        engine = Engine(model, EngineConfig(max_batch=4, max_len=256), mask_token_id=cfg.mask_token_id,
                        eos_token_ids=cfg.eos_token_ids, default_block_size=cfg.block_size)
        engine.start()
        try:
            futures = [
                engine.submit(GenerationRequest(
                    f"r{i}", plain.tokenizer.encode(prompt),
                    SamplingParams(max_new_tokens=16, steps_per_block=steps, strategy=strategy, seed=i)))
                for i, (prompt, steps, strategy) in enumerate(requests)
            ]
            results.append([f.result(timeout=60).token_ids for f in futures])
        finally:
            engine.stop()
    assert results[0] == results[1]
    assert all(results[0])


def test_an_error_every_rank_raises_before_any_all_reduce_keeps_the_group_in_step(
    pair: tuple[LoadedModel, TensorParallelModel],
) -> None:
    plain, tp = pair
    cache = tp.new_cache(max_seqs=1, max_len=8, device="cpu", dtype=torch.float32)
    slot = torch.tensor([cache.allocate()])
    ids = torch.zeros(1, 4, dtype=torch.long)
    pos = torch.arange(4)[None]
    with pytest.raises(ValueError, match="commit_lens"):
        tp(ids, pos, pos, cache=cache, slots=slot, commit_lens=torch.tensor([5]))
    assert tp.group.broken is None
    _close(plain.model(ids, pos, pos), tp(ids, pos, pos))  # the ranks still run the same forwards
    cache.free(0)
