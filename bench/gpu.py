"""``python -m bench.gpu``: the engine on an SDAR-30B-A3B-shaped model, on a GPU.

Builds a random-weight model with the shape of SDAR-30B-A3B (hidden 2048, 48 layers, 128
experts, top-8, moe_intermediate 768, 32 query / 4 KV heads, head_dim 128, vocab 151936) in
bfloat16 directly on the device (no checkpoint: nothing to download, ~61 GB of weights), then
runs the real engine (continuous batching, KV cache, block-diffusion sampler) at batch 1, 8 and
64 with block sizes 4 and 32, and prints tokens/s, passes/s and the achieved memory bandwidth.

Bandwidth is an estimate of bytes that must be read per forward: every non-expert weight once
(attention, router, norms, LM head), the weights of every expert that at least one token of the
pass is routed to (the number of distinct experts per layer is measured for the pass's token
count with a hook on the routers, in a separate calibration forward), and the KV cache rows the
pass attends to (the mean cached length of the run). It is compared with the device's spec peak
(a table of known GPUs, or ``--peak-gbps``) and with a device-to-device copy measured in the same
run (a practical ceiling).

``--tensor-parallel N`` runs the same model split over ``cuda:0..N-1`` (one worker's ranks; random
weights built per rank, replicated ones identical everywhere; ``--moe`` picks how the experts
split); the bytes per forward and the bandwidth are then rank 0's share.

``--weight-dtype int8`` (or ``int4``, ``--group-size``) quantizes the expert and projection matrices
after the build as ``CLOVERQ_WEIGHT_DTYPE`` does (``worker/model/quantize.py``: the CUDA kernels are
probed on the device, with a dequantize-then-matmul fallback); the bytes per forward are then the
quantized ones. Run it next to the bfloat16 run to measure the CUDA path.

Every sequence gets ``--new-tokens`` tokens after a ``--prompt-tokens`` prompt; EOS is disabled so
random weights cannot stop a run early; ``steps_per_block`` defaults to the block size (one
token per denoising pass, the most passes a block can take). The default sizes run in well
under five minutes on an H100/H200-class GPU. On a machine without a GPU, check that the script
runs with a reduced shape, e.g.::

    python -m bench.gpu --device cpu --dtype float32 --layers 2 --experts 8 --top-k 2 \\
        --hidden 128 --moe-intermediate 64 --heads 4 --kv-heads 2 --head-dim 32 --vocab 1024 \\
        --batches 1,4 --block-sizes 4,8 --new-tokens 16 --prompt-tokens 8
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.engine.engine import Engine, EngineConfig
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model import BlockCausalForBlockDiffusion, ModelConfig
from worker.model.checkpoint import _SkipParameterInit
from worker.model.moe import SparseMoE
from worker.model.parallel.plan import ShardPlan
from worker.model.parallel.shard import Shard, build_shard

# Spec HBM bandwidth in GB/s (decimal), matched against torch.cuda.get_device_name() in order.
PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM
    ("H800", 3350.0),
    ("GH200", 4000.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB
    ("A800", 2039.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
    ("RTX 6000 Ada", 960.0),
)


@dataclass(frozen=True)
class RunResult:
    batch: int
    block_size: int
    steps_per_block: int
    tokens: int
    passes: int
    forwards: int
    seconds: float
    forward_share: float
    bytes_per_forward: float


def sdar_30b_a3b_config(args: argparse.Namespace) -> ModelConfig:
    """SDAR-30B-A3B's shape (overridable from the command line for a reduced CPU check)."""
    return ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=6144,  # unused: every layer is MoE (no mlp_only_layers)
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        mask_token_id=args.vocab - 1,
        block_size=4,
        eos_token_ids=(),
    )


@torch.no_grad()
def build_random_model(
    config: ModelConfig, *, device: torch.device, dtype: torch.dtype
) -> BlockCausalForBlockDiffusion:
    """Allocate the model straight on ``device`` in ``dtype`` and fill it with random weights.

    Built on the meta device first, so no full-precision copy ever exists (61 GB in bf16 would be
    122 GB in fp32). Scales keep activations finite through 48 layers: unit-variance embeddings,
    1/sqrt(fan_in) projections, norm weights 1.
    """
    with torch.device("meta"):
        model = BlockCausalForBlockDiffusion(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    for name, param in model.named_parameters():
        if param.ndim == 1:
            param.fill_(1.0)
        elif "embed" in name:
            param.normal_(0.0, 1.0, generator=generator)
        else:  # nn.Linear [out, in] -> fan_in = in; stacked experts [E, in, out] -> fan_in = in
            fan_in = param.shape[-1] if param.ndim == 2 else param.shape[1]
            param.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=generator)
    return model.eval()


@dataclass(frozen=True)
class RandomShards:
    """Random weights for each rank of a tensor-parallel run (``worker.model.parallel.launch.launch``).

    Every parameter is drawn from a generator seeded by its name, with the scale of the whole
    model's fan-in, so replicated tensors (embedding, norms, routers) are identical on every rank.
    """

    seed: int = 0

    @torch.no_grad()
    def build(self, config: ModelConfig, plan: ShardPlan, *, device: torch.device, dtype: torch.dtype,
              reduce: Callable[[torch.Tensor], None]) -> Shard:
        shard = build_shard(config, plan, device=device, dtype=dtype, reduce=reduce)
        with torch.device("meta"), _SkipParameterInit():  # shapes only: no (slow) init on meta
            full = {n: p.shape for n, p in BlockCausalForBlockDiffusion(config).named_parameters()}
        for name, param in shard.model.named_parameters():
            seed = self.seed * 1_000_003 + zlib.crc32(name.encode())
            generator = torch.Generator(device=device).manual_seed(seed)
            shape = full[name]
            if param.ndim == 1:
                param.fill_(1.0)
            elif "embed" in name:
                param.normal_(0.0, 1.0, generator=generator)
            else:
                fan_in = shape[-1] if len(shape) == 2 else shape[1]
                param.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=generator)
        shard.model.eval()
        return shard


def _modules(model: Any) -> torch.nn.Module:
    """The module tree whose weights this process holds (rank 0's shard under tensor parallelism)."""
    shard = getattr(model, "shard", None)
    return shard.model if shard is not None else model


def _expert_bytes(model: BlockCausalForBlockDiffusion) -> tuple[float, float]:
    """(bytes of every non-expert weight, bytes of one expert of one layer)."""
    model = _modules(model)
    dense = 0.0
    per_expert = 0.0
    for module in model.modules():
        if isinstance(module, SparseMoE):  # a stacked parameter, or int8/int4 buffers (--weight-dtype)
            experts = sum(_bytes(w) for w in (module.w_gate_up, module.w_down))
            per_expert = experts / module.num_experts
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if "w_gate_up" in name or "w_down" in name or "embed" in name:
            continue  # experts counted per pass; only a few embedding rows are read
        dense += tensor.numel() * tensor.element_size()
    return dense, per_expert


def _bytes(weights: torch.Tensor | torch.nn.Module) -> float:
    if isinstance(weights, torch.Tensor):
        return float(weights.numel() * weights.element_size())
    return float(sum(t.numel() * t.element_size() for t in weights.buffers()))


@torch.no_grad()
def distinct_experts_per_layer(
    model: BlockCausalForBlockDiffusion, tokens: int, *, device: torch.device
) -> float:
    """Mean number of distinct experts the router picks for ``tokens`` tokens (one pass's worth)."""
    counts: list[int] = []

    def hook(module: torch.nn.Module, _inputs: object, logits: torch.Tensor) -> None:
        top = torch.topk(logits.float(), model.config.num_experts_per_tok, dim=-1).indices  # [N, K]
        counts.append(int(torch.unique(top).numel()))

    routers = [m.router for m in _modules(model).modules() if isinstance(m, SparseMoE)]
    handles = [router.register_forward_hook(hook) for router in routers]
    try:
        generator = torch.Generator(device=device).manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size - 1, (1, tokens), device=device, generator=generator)
        positions = torch.arange(tokens, device=device)[None]  # [1, T]
        block_ids = torch.zeros_like(positions)  # one block: full attention, like a denoising pass
        model(ids, positions, block_ids)
    finally:
        for handle in handles:
            handle.remove()
    return statistics.fmean(counts) if counts else 0.0


def _kv_bytes_per_position(config: ModelConfig, dtype: torch.dtype) -> float:
    element = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * element


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbps(device: torch.device, *, megabytes: int) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time), best of a few repeats."""
    src = torch.empty(megabytes * 1024 * 1024, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        _sync(device)
        began = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - began)
    del src, dst
    return 2 * megabytes * 1024 * 1024 / best / 1e9


def run_engine(
    model: BlockCausalForBlockDiffusion,
    *,
    batch: int,
    block_size: int,
    steps_per_block: int,
    prompt_tokens: int,
    new_tokens: int,
    device: torch.device,
) -> tuple[int, int, int, float, float]:
    """One engine, ``batch`` requests submitted at once; returns (tokens, passes, forwards, s, fwd share)."""
    config = model.config
    max_len = prompt_tokens + new_tokens + 2 * block_size

    def make(positions: int) -> Engine:
        return Engine(
            model,
            EngineConfig(max_batch=batch, max_tokens_in_flight=positions, max_len=max_len),
            mask_token_id=config.mask_token_id if config.mask_token_id is not None else config.vocab_size - 1,
            eos_token_ids=(),
            default_block_size=block_size,
        )

    engine = make(batch * max_len)
    if engine.state_positions:  # a hybrid model's recurrent state counts as positions of equal bytes
        engine = make(batch * (max_len + engine.state_positions))
    engine.start()
    try:
        engine.warm_up()  # kernels for this block size, allocator warm
        generator = torch.Generator().manual_seed(batch * 1000 + block_size)
        prompts = torch.randint(0, config.vocab_size - 1, (batch, prompt_tokens), generator=generator)
        params = SamplingParams(
            max_new_tokens=new_tokens, block_size=block_size, steps_per_block=steps_per_block, seed=0
        )
        before = engine.stats()
        _sync(device)
        began = time.perf_counter()
        futures = [
            engine.submit(GenerationRequest(f"bench-{i}", prompts[i].tolist(), params)) for i in range(batch)
        ]
        results = [f.result() for f in futures]
        _sync(device)
        seconds = time.perf_counter() - began
        after = engine.stats()
    finally:
        engine.stop(drain=False, timeout=60)
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"engine requests failed: {failed[:3]}")
    busy = after.busy_seconds - before.busy_seconds
    forward = after.forward_seconds - before.forward_seconds
    return (
        sum(r.tokens for r in results),
        after.passes - before.passes,
        after.forwards - before.forwards,
        seconds,
        forward / busy if busy > 0 else 0.0,
    )


def _parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (reduced-size check)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batches", type=_parse_ints, default=[1, 8, 64])
    parser.add_argument("--block-sizes", type=_parse_ints, default=[4, 32])
    parser.add_argument("--steps-per-block", type=int, default=None, help="default: the block size")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--peak-gbps", type=float, default=None, help="spec memory bandwidth, GB/s")
    parser.add_argument("--copy-mb", type=int, default=2048, help="size of the copy-bandwidth probe")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="ranks (devices from --device on)")
    parser.add_argument("--moe", choices=["columns", "experts"], default="columns",
                        help="tensor parallel: experts split by columns or whole per rank")
    parser.add_argument("--weight-dtype", choices=["int8", "int4"], default=None,
                        help="weight-only quantization of the expert and projection matrices after the "
                        "build (worker/model/quantize.py, CLOVERQ_WEIGHT_DTYPE); --dtype stays for the rest")
    parser.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64, help="int4 group")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "no CUDA device: run on a GPU machine, or pass --device cpu with a reduced shape", file=sys.stderr
        )
        return 2
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    config = sdar_30b_a3b_config(args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_gbps or next((gbps for key, gbps in PEAK_GBPS if key in name), None)

    if args.tensor_parallel > 1:
        from bench.gpu import RandomShards as Source  # by its module name: it travels to the ranks
        from worker.model.parallel.launch import launch

        model: Any = launch(Source(), config, world=args.tensor_parallel, device=device, dtype=dtype,
                            moe=args.moe)
    else:
        model = build_random_model(config, device=device, dtype=dtype)
    quantized = ""
    if args.weight_dtype:
        if args.tensor_parallel > 1:
            print("--weight-dtype is not supported with --tensor-parallel yet", file=sys.stderr)
            return 2
        from worker.model.quantize import quantize_model

        mode = "int8" if args.weight_dtype == "int8" else f"int4-g{args.group_size}"
        quantized = f"   {quantize_model(model, mode)}"
    _sync(device)
    params = sum(p.numel() for p in model.parameters())
    dense_bytes, expert_bytes = _expert_bytes(model)
    kv_per_position = _kv_bytes_per_position(_modules(model).config, dtype)
    copy_gbps = copy_bandwidth_gbps(device, megabytes=args.copy_mb)
    tp = f"   tensor parallel: {args.tensor_parallel} ({args.moe})" if args.tensor_parallel > 1 else ""
    built = time.perf_counter() - started
    print(f"device: {name}   dtype: {args.dtype}   build: {built:.1f} s{tp}{quantized}")
    print(
        f"model{' (rank 0)' if tp else ''}: {params / 1e9:.3f} B parameters "
        f"({params * dtype.itemsize / 1e9:.2f} GB), "
        f"{config.num_hidden_layers} layers, {config.num_experts} experts top-{config.num_experts_per_tok}, "
        f"hidden {config.hidden_size}, vocab {config.vocab_size}"
    )
    print(
        f"bandwidth baselines: spec peak {f'{peak:.0f} GB/s' if peak else 'unknown (--peak-gbps)'}, "
        f"measured device copy {copy_gbps:.0f} GB/s"
    )
    if device.type == "cuda":
        print(f"memory after build: {torch.cuda.memory_allocated(device) / 1e9:.1f} GB allocated")

    results: list[RunResult] = []
    for block_size in args.block_sizes:
        steps = args.steps_per_block or block_size
        for batch in args.batches:
            distinct = distinct_experts_per_layer(model, batch * block_size, device=device)
            mean_cached = args.prompt_tokens + args.new_tokens / 2
            bytes_per_forward = (
                dense_bytes
                + config.num_hidden_layers * distinct * expert_bytes
                + batch * mean_cached * kv_per_position
            )
            tokens, passes, forwards, seconds, share = run_engine(
                model,
                batch=batch,
                block_size=block_size,
                steps_per_block=steps,
                prompt_tokens=args.prompt_tokens,
                new_tokens=args.new_tokens,
                device=device,
            )
            results.append(
                RunResult(
                    batch, block_size, steps, tokens, passes, forwards, seconds, share, bytes_per_forward
                )
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()

    header = (
        f"{'batch':>5} {'block':>5} {'steps':>5} {'tokens':>7} {'passes':>6} {'fwd':>5} {'sec':>7} "
        f"{'tok/s':>9} {'pass/s':>7} {'fwd%':>5} {'GB/fwd':>7} {'GB/s':>7} {'%peak':>6} {'%copy':>6}"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in results:
        gbps = r.bytes_per_forward * r.forwards / r.seconds / 1e9
        print(
            f"{r.batch:>5} {r.block_size:>5} {r.steps_per_block:>5} {r.tokens:>7} {r.passes:>6} "
            f"{r.forwards:>5} {r.seconds:>7.2f} {r.tokens / r.seconds:>9.1f} {r.passes / r.seconds:>7.1f} "
            f"{100 * r.forward_share:>5.1f} {r.bytes_per_forward / 1e9:>7.3f} {gbps:>7.1f} "
            f"{(f'{100 * gbps / peak:.1f}' if peak else '-'):>6} {100 * gbps / copy_gbps:>6.1f}"
        )
    if device.type == "cuda":
        print(f"\npeak memory: {torch.cuda.max_memory_allocated(device) / 1e9:.1f} GB")
    print(f"total: {time.perf_counter() - started:.1f} s")
    if args.tensor_parallel > 1:
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
