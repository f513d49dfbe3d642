"""Tensor parallelism with quantized weights: int8/int4 per rank (``parallel/quant.py``) and FP8
block-scaled checkpoints read slice by slice (``parallel/shard.py``), on CPU with gloo.

The shards first, in this process: int8 shards hold exactly the single-device codes and scales
(row-parallel matrices take each row's scale from the whole row), and an FP8 checkpoint's shards
are exactly the shards of its dequantized weights, with blocks of 24 x 40 so that shard
boundaries fall inside scale blocks. Then two real ranks against one device.

Tolerances (measured here, 2 ranks vs 1, fp32 elsewhere; ``max |dlogit| / max(1, max |logit|)``
over three passes): int8 with float32 dequantized matmuls 9.5e-7 (Clover) / 5.3e-7 (SDAR), FP8
9.3e-7 / 4.5e-7, both held to 1e-5 (the same weights summed in another order, as fp32 TP). int8 as
served (``int8-fused``: the fused kernels at <= 12 rows take and return bfloat16, so a row-parallel
shard rounds its partial sum to bfloat16) 5.1e-3 / 5.8e-3, held to 2e-2: the size of TP=1's own
fused-vs-dequantized difference (2-5e-3 on the same passes), so greedy identity through the engine
is checked on the float32 path (and FP8). int4 (group 32) 0.37 against int4's own 0.90 from
float32: the demo's expert and shared-expert widths split to 16 inputs a rank, which no int4
group divides, so TP=2 holds those row-parallel matrices in int8 (and logs it).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from worker.engine.engine import Engine, EngineConfig
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model import fp8, quantize
from worker.model.checkpoint import (
    INDEX_NAME,
    SINGLE_NAME,
    LoadedModel,
    load_checkpoint,
    read_config,
    weight_files,
)
from worker.model.loader import load_model
from worker.model.manifest import write_manifest
from worker.model.parallel.launch import close_active, launch
from worker.model.parallel.plan import MoeMode, make_plan
from worker.model.parallel.proxies import TensorParallelModel
from worker.model.parallel.quant import local_amax, quantize_shard, row_parallel_int8
from worker.model.parallel.shard import Shard, build_shard, load_shard_weights
from worker.model.parallel.sources import CheckpointSource
from worker.model.planner import rank_weight_bytes
from worker.model.quant_rules import parse_mode
from worker.model.quantize import (
    Int4Linear,
    Int8Linear,
    QuantizedExperts,
    model_bytes,
    quantize_model,
)

BLOCK = (24, 40)  # FP8 scale blocks that shard boundaries (multiples of 16) cut through
# max |TP=2 - TP=1| logit / max(1, max |logit|), by case (measured values in the comments)
TOLERANCE = {"int8": 1e-5, "fp8": 1e-5, "int8-fused": 2e-2}


def _shards(path: Path, world: int = 2, moe: MoeMode = "columns") -> list[Shard]:
    config = read_config(path)
    shards = []
    for rank in range(world):
        shard = build_shard(config, make_plan(config, rank, world, moe), device="cpu", dtype=torch.float32,
                            reduce=lambda t: None)
        assert load_shard_weights(shard, weight_files(path), config) == sum(
            p.numel() for p in shard.model.parameters())  # only its slices read, scales aside
        shards.append(shard)
    return shards


def _assert_same_parameters(got: list[Shard], want: list[Shard]) -> None:
    """Rank by rank, the same parameter names with equal values. Two ranks each and no rank without
    parameters are asserted first: a loop over no shards, or ``all`` over an empty dict, would pass."""
    assert len(got) == len(want) == 2
    for shard, reference in zip(got, want, strict=True):
        params, expected = dict(shard.model.named_parameters()), dict(reference.model.named_parameters())
        assert params and params.keys() == expected.keys()
        assert all(torch.equal(params[n], expected[n]) for n in params), [
            n for n in params if not torch.equal(params[n], expected[n])]


def _quantize_in_process(shards: list[Shard], mode: str) -> None:
    """``quantize_shard`` on every shard, the group's MAX all-reduce done here."""
    parsed = parse_mode(mode)
    assert parsed is not None
    whole = torch.stack([local_amax(s, row_parallel_int8(s, parsed)) for s in shards]).amax(0)
    for shard in shards:
        quantize_shard(shard, parsed, reduce_max=lambda v: whole)


def _arch_path(arch: str, demo_checkpoint: Path, sdar_checkpoint: Path) -> Path:
    return demo_checkpoint if arch == "clover" else sdar_checkpoint


# --- shards in this process -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["clover", "sdar"])
def test_int8_shards_hold_the_single_device_codes(arch: str, demo_checkpoint: Path,
                                                  sdar_checkpoint: Path) -> None:
    path = _arch_path(arch, demo_checkpoint, sdar_checkpoint)
    single = load_checkpoint(path, verify=False).model
    quantize_model(single, "int8")
    shards = _shards(path)
    _quantize_in_process(shards, "int8")
    mods = [dict(s.model.named_modules()) for s in shards]
    assert len(mods) == 2  # the all() below is over both ranks, never over none
    whole = dict(single.named_modules())
    mixer = "layers.1.mixer" if arch == "clover" else "layers.1.attn"
    checks = [(f"{mixer}.q_proj", 0), (f"{mixer}.o_proj", 1)]  # column-, row-parallel
    checks += [("layers.1.mlp.w_down", 2)]  # dequantized [E, N, K]
    if arch == "clover":
        checks += [("layers.0.mixer.out_proj", 1), ("layers.1.mlp.shared_expert.down_proj", 1)]
    else:
        checks += [("layers.0.mlp.down_proj", 1)]  # the dense layer
    for name, dim in checks:
        assert all(isinstance(m[name], (Int8Linear, QuantizedExperts)) for m in mods), name
        got = torch.cat([m[name].dequantized() for m in mods], dim=dim)
        assert torch.equal(got, whole[name].dequantized()), name  # same codes, same scales
    # the experts' gate/up columns: each rank holds its gate columns, then its up columns
    gate_up = [m["layers.1.mlp.w_gate_up"].dequantized().chunk(2, dim=1) for m in mods]
    want = whole["layers.1.mlp.w_gate_up"].dequantized()
    assert torch.equal(torch.cat([g for g, _ in gate_up] + [u for _, u in gate_up], dim=1), want)


def test_int4_groups_stay_inside_the_shard_or_fall_back(demo_checkpoint: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    shards = _shards(demo_checkpoint)
    with caplog.at_level(logging.WARNING, logger="worker.model.parallel.quant"):
        _quantize_in_process(shards, "int4-g32")
    mods = dict(shards[1].model.named_modules())
    o_proj = mods["layers.1.mixer.o_proj"]
    assert isinstance(o_proj, Int4Linear) and o_proj.group == 32 and o_proj.in_features == 32
    assert mods["layers.1.mlp.w_gate_up"].kind == "int4"  # whole rows of 64 inputs
    assert mods["layers.1.mlp.w_down"].kind == "int8"  # 16 inputs a rank: no int4 group divides it
    assert isinstance(mods["layers.1.mlp.shared_expert.down_proj"], Int8Linear)
    said = [r.getMessage() for r in caplog.records]
    assert any("input width 16" in m and "held in int8" in m for m in said), said


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> Qwen3.5's fused ``experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]."""
    out = dict(tensors)
    layers = {n.split(".experts.")[0] for n in tensors if ".experts." in n}
    for mlp in sorted(layers):
        count = sum(n.startswith(f"{mlp}.experts.") and n.endswith("down_proj.weight") for n in tensors)
        gate_up = [torch.cat((out.pop(f"{mlp}.experts.{e}.gate_proj.weight"),
                              out.pop(f"{mlp}.experts.{e}.up_proj.weight"))) for e in range(count)]
        out[f"{mlp}.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"{mlp}.experts.down_proj"] = torch.stack([out.pop(f"{mlp}.experts.{e}.down_proj.weight")
                                                       for e in range(count)])
    return out


def _write_fp8(src: Path, dst: Path, block: tuple[int, int] = BLOCK, *, fused: bool = False) -> Path:
    """``src`` with its projection and expert matrices stored as FP8 in ``block`` scale blocks (the
    experts fused into stacks with ``fused``), and (returned) the float32 checkpoint of the weights
    they stand for (``dst``-dequantized)."""
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    with safe_open(str(src / SINGLE_NAME), framework="pt") as f:
        source = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    for name, t in (_fuse_experts(source) if fused else source).items():
        expected[name] = t
        if name.endswith(("proj.weight", "experts.gate_up_proj", "experts.down_proj")) and not name.endswith(
                ("in_proj_a.weight", "in_proj_b.weight")):
            pairs = [fp8.quantize(m, block) for m in (t if t.ndim == 3 else t[None])]
            codes, scale_inv = (torch.stack(x) for x in zip(*pairs, strict=True))
            if t.ndim == 2:
                codes, scale_inv = codes[0], scale_inv[0]
            tensors[name], tensors[fp8.scale_name(name)] = codes, scale_inv
            expected[name] = fp8.dequantize(codes, scale_inv, block)
        else:
            tensors[name] = t
    reference = dst.with_name(dst.name + "-dequantized")
    for folder, weights in ((dst, tensors), (reference, expected)):
        shutil.copytree(src, folder)
        save_file(weights, str(folder / SINGLE_NAME), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    for folder in (dst, reference):
        write_manifest(folder)
    return reference


@pytest.mark.parametrize("arch", ["clover", "sdar"])
def test_fp8_shards_are_the_shards_of_the_dequantized_weights(arch: str, demo_checkpoint: Path,
                                                              sdar_checkpoint: Path, tmp_path: Path) -> None:
    path = _arch_path(arch, demo_checkpoint, sdar_checkpoint)
    reference = _write_fp8(path, tmp_path / "fp8")
    _assert_same_parameters(_shards(tmp_path / "fp8"), _shards(reference))
    # and the single-device loader agrees with the reference on the whole tensors
    single = dict(load_checkpoint(tmp_path / "fp8", verify=False).model.named_parameters())
    whole = dict(load_checkpoint(reference, verify=False).model.named_parameters())
    assert single and single.keys() == whole.keys()
    assert all(torch.equal(single[n], whole[n]) for n in single)


@pytest.mark.parametrize("moe", ["columns", "experts"])
def test_fp8_fused_expert_stacks_are_read_by_slices(moe: MoeMode, demo_checkpoint: Path,
                                                     tmp_path: Path) -> None:
    """Qwen3.5's fused stacks: gate and up column ranges (a range starting inside a scale block),
    down's input columns, or whole experts (the scales' leading dim)."""
    reference = _write_fp8(demo_checkpoint, tmp_path / "fp8", fused=True)
    _assert_same_parameters(_shards(tmp_path / "fp8", moe=moe), _shards(reference, moe=moe))


# --- two real ranks ---------------------------------------------------------------------------------
Pair = tuple[str, LoadedModel, TensorParallelModel, torch.nn.Module | None]  # format, 1 device, 2 ranks, fp32


@dataclass(frozen=True)
class _DequantizedInt8(CheckpointSource):
    """A rank that runs every int8 matmul dequantized in float32 (``FUSED_INT8_MAX_ROWS = 0``): no
    bfloat16 kernel inputs and outputs, so TP=2 and TP=1 differ by float32 rounding only."""

    def build(self, *args: Any, **kwargs: Any) -> Shard:
        quantize.FUSED_INT8_MAX_ROWS = 0
        return super().build(*args, **kwargs)


@pytest.fixture(scope="module", params=["clover/int8", "sdar/int8", "clover/int8-fused", "sdar/int8-fused",
                                        "clover/int4-g32", "clover/fp8", "sdar/fp8"])
def quant_pair(request: pytest.FixtureRequest, demo_checkpoint: Path, sdar_checkpoint: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """One device and 2 ranks of the same checkpoint in the same weight format (``int8``: float32
    dequantized matmuls on both; ``int8-fused``: the fused bfloat16 kernels at <= 12 rows, as served)."""
    arch, mode = request.param.split("/")
    path = _arch_path(arch, demo_checkpoint, sdar_checkpoint)
    quant: str | None = mode.removesuffix("-fused")
    if mode == "fp8":
        path = tmp_path_factory.mktemp(f"fp8-{arch}") / "tiny"
        _write_fp8(_arch_path(arch, demo_checkpoint, sdar_checkpoint), path)
        quant = None
    rows = quantize.FUSED_INT8_MAX_ROWS
    source = CheckpointSource(str(path))
    if mode == "int8":
        quantize.FUSED_INT8_MAX_ROWS = 0  # this process (rank 0 and the one device); rank 1: the source
        source = _DequantizedInt8(str(path))
    try:
        plain = load_model(path, weight_dtype=quant, dtype=torch.float32, verify=False)
        fp32 = load_checkpoint(path, verify=False).model if mode.startswith("int4") else None
        tp = launch(source, plain.config, world=2, threads=1, weight_dtype=quant)
        yield mode, plain, tp, fp32
    finally:
        close_active()
        quantize.FUSED_INT8_MAX_ROWS = rows


def _passes(model: Any, config: Any) -> list[torch.Tensor]:
    """Logits of a pass without cache (24 rows a matmul), a prefill, then a pass of 4 rows (the
    fused int8 kernels' regime)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=gen)
    pos = torch.arange(12).expand(2, -1)
    cache = model.new_cache(max_seqs=2, max_len=64, device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate(), cache.allocate()])
    out = [model(ids, pos, pos // 4),
           model(ids, pos, pos // 4, cache=cache, slots=slots, commit_lens=torch.tensor([12, 12])),
           model(ids[:, :2], pos[:, :2] + 12, (pos[:, :2] + 12) // 4, cache=cache, slots=slots,
                 commit_lens=torch.tensor([0, 0]))]  # fmt: skip
    cache.free(0)
    cache.free(1)
    return out


def _error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max |got - want| / max(1, max |want|) over the passes."""
    pairs = zip(got, want, strict=True)
    return max((g - w).abs().max().item() / max(1.0, w.abs().max().item()) for g, w in pairs)


def test_tp2_logits_equal_tp1_in_the_same_weight_format(quant_pair: Pair) -> None:
    mode, plain, tp, fp32 = quant_pair
    want = _passes(plain.model, plain.config)
    got = _passes(tp, plain.config)
    assert [g.shape for g in got] == [w.shape for w in want]
    worst = _error(got, want)
    print(f"{plain.config.family} {mode}: TP=2 vs TP=1 max |dlogit| / max |logit| = {worst:.2e}")
    if fp32 is None:
        assert worst <= TOLERANCE[mode], worst
    else:  # int4: TP=2 holds some matrices in int8; closer to TP=1 than int4 is to float32
        own = _error(want, _passes(fp32, plain.config))
        print(f"{plain.config.family} {mode}: TP=1 vs float32 {own:.2e}")
        assert worst < own, (worst, own)


def test_greedy_tokens_identical_through_the_engine(quant_pair: Pair) -> None:
    mode, plain, tp, _ = quant_pair
    if mode not in ("int8", "fp8"):
        pytest.skip("bfloat16 kernels (int8-fused) / some int8 matrices (int4): rounding-level differences "
                    "flip the demo's near-tie tokens")
    cfg = plain.config
    results = []
    requests = [("The quick brown fox", 4), ("Hello", 2)]
    for model in (plain.model, tp):
        engine = Engine(model, EngineConfig(max_batch=4, max_len=256), mask_token_id=cfg.mask_token_id,
                        eos_token_ids=cfg.eos_token_ids, default_block_size=cfg.block_size)
        engine.start()
        try:
            params = [SamplingParams(max_new_tokens=16, steps_per_block=steps, seed=i)
                      for i, (_, steps) in enumerate(requests)]
            futures = [engine.submit(GenerationRequest(f"r{i}", plain.tokenizer.encode(prompt), p))
                       for i, ((prompt, _), p) in enumerate(zip(requests, params, strict=True))]
            results.append([f.result(timeout=60).token_ids for f in futures])
        finally:
            engine.stop()
    assert len(results) == 2 and len(results[0]) == len(requests)
    assert results[0] == results[1]
    assert all(results[0])


@pytest.mark.parametrize("mode", ["int8", "int4-g32"])
def test_planner_counts_each_rank_s_quantized_bytes(mode: str, demo_checkpoint: Path) -> None:
    """``planner.rank_weight_bytes`` against the quantized shards' parameter + buffer bytes."""
    shards = _shards(demo_checkpoint)
    _quantize_in_process(shards, mode)
    config = read_config(demo_checkpoint)
    assert [shard.plan.rank for shard in shards] == [0, 1]  # both ranks measured, not none
    for shard in shards:
        predicted = rank_weight_bytes(config, mode.split("-")[0], world=2, rank=shard.plan.rank,
                                      high_precision="fp32", group_size=32)
        measured = model_bytes(shard.model)
        assert measured == predicted.total, (shard.plan.rank, measured, predicted)  # exact


def test_fp8_scales_in_another_file_of_a_sharded_checkpoint(sdar_checkpoint: Path, tmp_path: Path) -> None:
    reference = _write_fp8(sdar_checkpoint, tmp_path / "fp8")
    folder = tmp_path / "fp8"
    tensors = load_file(str(folder / SINGLE_NAME))
    (folder / SINGLE_NAME).unlink()
    parts = {"a.safetensors": {n: t for n, t in tensors.items() if not fp8.is_scale(n)},
             "b.safetensors": {n: t for n, t in tensors.items() if fp8.is_scale(n)}}  # fmt: skip
    for file, part in parts.items():
        save_file(part, str(folder / file), metadata={"format": "pt"})
    index = {"weight_map": {n: file for file, part in parts.items() for n in part}}
    (folder / INDEX_NAME).write_text(json.dumps(index))
    _assert_same_parameters(_shards(folder), _shards(reference))


def test_the_worker_loader_quantizes_each_rank(demo_checkpoint: Path) -> None:
    """``load_sharded`` passes ``CLOVERQ_WEIGHT_DTYPE`` / ``CLOVERQ_WEIGHT_GROUP_SIZE`` to the ranks
    (it refused them before)."""
    from types import SimpleNamespace

    from scheduler.fleet.workers import WorkerInfo
    from worker.tensor_parallel import load_sharded

    model = SimpleNamespace(weight_dtype="int4", weight_group_size=32, skip_verify=True,
                            verify_on_load="quick", device="cpu")  # fmt: skip
    settings = SimpleNamespace(engine=SimpleNamespace(tensor_parallel=2), model=model,
                               resolved_torch_threads=2)  # fmt: skip
    info = WorkerInfo(id="w", hostname="h", pid=1, queues=[], state="starting")
    runtime = SimpleNamespace(settings=settings, info=info,
                              load_dtype=lambda path: torch.float32)  # fmt: skip
    try:
        loaded = load_sharded(runtime, demo_checkpoint)
        kinds = {type(m) for m in loaded.model.shard.model.modules()}  # type: ignore[attr-defined]
        assert Int4Linear in kinds and QuantizedExperts in kinds
        assert runtime.info.stats["tensor_parallel"]["weight_dtype"] == "int4"
        ids = torch.zeros(1, 4, dtype=torch.long)
        pos = torch.arange(4)[None]
        assert torch.isfinite(loaded.model(ids, pos, pos)).all()
    finally:
        close_active()
