"""``python -m bench.gpu_clover``: long prompts and decoding on a Clover-35B-A3B-shaped model, on a GPU.

Builds a random-weight model with Clover-35B-A3B-Preview's shape (CLOVER.md: the ``qwen3_5_moe``
trunk, 40 layers of which every fourth is full attention and the rest Gated DeltaNet, hidden 2048,
256 experts top-8 of width 512 plus a gated shared expert, 16 q / 2 KV heads of 256, vocab 248320;
about 35 B parameters, ~70 GB in bfloat16) straight on the device, then measures, in one run:

  1. **Prefill cost by prompt length** (issue 26): a prompt of 1K ... 128K tokens committed in
     ``--chunk``-token chunks, as chunked prefill runs it; microseconds per prompt token and the
     ratio to the 1K figure (the goal: 32K within 2x of 1K), with flash-linear-attention's Gated
     DeltaNet kernel when it is installed and agrees with the torch form on the probe
     (``worker/model/delta_rule.py``), and with the torch chunked form, so the two are compared on
     the same lengths in the same run.
  2. **Short jobs under long prefills**: the ``bench.long`` part 2 on this model: 8-token jobs while
     ``--long``-token prompts prefill one after another, unchunked and chunked, against the idle
     baseline measured in the same run.
  3. **Decoding**: the real engine at batch 1, 8 and 64 with Clover's block of 32, one token per
     pass (``steps_per_block`` = 32; random weights cannot reach the confidence threshold):
     tokens/s and passes/s.

``--tiny`` swaps in a reduced shape so the script can be checked on a CPU::

    python -m bench.gpu_clover --device cpu --dtype float32 --tiny --lengths 256,512 --long 512 \\
        --chunk 128 --batches 1,2 --new-tokens 64
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bench.gpu import run_engine
from bench.long import _p, chunk_costs, prefill_costs, short_jobs
from worker.model import delta_rule
from worker.model.config import ModelConfig
from worker.model.family import DiffusionModel, build_model

# CLOVER.md's trunk, as a config.json would spell it (clover_moe reads qwen3_5_moe's fields).
CLOVER_35B_A3B: dict[str, Any] = {
    "model_type": "clover_moe",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000_000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "block_size": 32,
}
# The same trunk shrunk for a CPU check of this script (not a measurement).
TINY = {
    "vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 32, "linear_value_head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
}  # fmt: skip


@dataclass(frozen=True)
class BuiltModel:
    """What ``bench.long``'s measurements read: the model and its config (no tokenizer needed)."""

    model: DiffusionModel
    config: ModelConfig


def clover_config(tiny: bool) -> ModelConfig:
    d = dict(CLOVER_35B_A3B, **(TINY if tiny else {}))
    d["mask_token_id"] = d["vocab_size"] - 1
    return ModelConfig.from_hf_dict(d)


@torch.no_grad()
def build_random_clover(config: ModelConfig, *, device: torch.device, dtype: torch.dtype) -> DiffusionModel:
    """The hybrid model allocated on ``device`` in ``dtype`` (built on meta: no fp32 copy), random.

    Scales keep activations finite through 40 layers: unit-variance embeddings, 1/sqrt(fan_in)
    matrices, zero-centred norm weights 0 (they multiply by 1 + w), other vectors 1 except the GDN
    decay (``A_log`` 0: A = 1) and the preview history slot. Float32 buffers (the GDN state math)
    keep their dtype, as the loader keeps them.
    """
    with torch.device("meta"):
        model = build_model(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    for name, param in model.named_parameters():
        if "embed" in name:
            param.normal_(0.0, 1.0, generator=generator)
        elif param.ndim == 1:
            zero_centred = name.endswith("norm.weight") and "linear_attn.norm" not in name
            param.fill_(0.0 if zero_centred or name.endswith(("A_log", "dt_bias")) else 1.0)
        elif "conv" in name:  # depthwise taps [C, 1, K] or [C, K-1]: fan-in is the taps
            param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]), generator=generator)
        else:  # nn.Linear [out, in] -> fan_in = in; stacked experts [E, in, out] -> fan_in = in
            fan_in = param.shape[-1] if param.ndim == 2 else param.shape[1]
            param.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=generator)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _use_fla(device: torch.device, dtype: torch.dtype, on: bool) -> bool:
    """Switch the Gated DeltaNet path between fla's kernel (when it probed fine) and the torch form."""
    key = (device.type, device.index, torch.float32)  # delta_rule runs in float32
    delta_rule._FLA.pop(key, None)
    if not on:
        delta_rule._FLA[key] = None
    return delta_rule._fla_kernel(device, torch.float32) is not None if device.type == "cuda" else False


def part_prefill(
    built: BuiltModel, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> None:
    lengths = tuple(int(x) for x in args.lengths.split(","))
    print(f"\n[1] prefill cost by prompt length, the engine's chunks for a {args.chunk}-token budget")
    print(f"{'GDN path':>10} {'tokens':>7} {'seconds':>8} {'us/token':>9} {'vs first':>8} {'GPU GB':>7}")
    paths = ["fla", "torch"] if _use_fla(device, dtype, True) else ["torch"]
    for path in paths:
        _use_fla(device, dtype, path == "fla")
        prefill_costs(built, (lengths[0],), args.chunk)  # warm-up: kernels, autotuning, allocator
        todo = lengths if path == paths[0] else tuple(x for x in lengths if x <= args.torch_max)
        first = None
        for length in todo:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ((_, per_token, _, _),) = prefill_costs(built, (length,), args.chunk)  # the engine's chunks
            seconds = per_token * length  # (prefill_costs also times fixed chunks: not counted)
            first = first or per_token
            gpu = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0
            print(f"{path:>10} {length:>7} {seconds:>8.2f} {per_token * 1e6:>9.1f} "
                  f"{per_token / first:>7.2f}x {gpu:>7.1f}", flush=True)
            if seconds > args.length_budget:
                print(f"{'':>10} (stopping this path: {seconds:.0f} s > {args.length_budget:.0f} s)")
                break
    _use_fla(device, dtype, True)


def part_short_jobs(built: BuiltModel, args: argparse.Namespace) -> None:
    costs = chunk_costs(built, args.chunk, args.long)
    tokens, one_pass = costs.forward_at["halfway"]
    print(f"\n[2] {args.shorts} 8-token jobs every {args.short_every * 1000:.0f} ms; long prompts of "
          f"{args.long} tokens one after another; one chunk as the engine cuts a {args.chunk}-token budget "
          f"(W = {costs.token_keys}) after {args.long // 2} tokens: {tokens} tokens, "
          f"{one_pass * 1000:.1f} ms")
    kw = dict(long_tokens=args.long, shorts=args.shorts, every=args.short_every)
    runs = {
        "idle": short_jobs(built, chunk=args.chunk, with_long=False, **kw),
        "long, unchunked": short_jobs(built, chunk=0, with_long=True, **kw),
        "long, chunked": short_jobs(built, chunk=args.chunk, with_long=True, **kw),
    }
    idle = _p(runs["idle"][0], 0.95)
    print(f"{'run':>16} {'wait p50 ms':>12} {'wait p95 ms':>12} {'latency p50 ms':>15} "
          f"{'latency p95 ms':>15}")
    for name, (waits, latencies) in runs.items():
        print(f"{name:>16} {_p(waits, 0.5) * 1e3:>12.1f} {_p(waits, 0.95) * 1e3:>12.1f} "
              f"{_p(latencies, 0.5) * 1e3:>15.1f} {_p(latencies, 0.95) * 1e3:>15.1f}")
    goal = 1.5 * idle + one_pass
    chunked = _p(runs["long, chunked"][0], 0.95)
    print(f"goal: chunked wait p95 <= 1.5 x idle p95 + one chunk = {goal * 1e3:.1f} ms; measured "
          f"{chunked * 1e3:.1f} ms ({'met' if chunked <= goal else 'missed'})")


def part_decode(built: BuiltModel, args: argparse.Namespace, device: torch.device) -> None:
    block = 32 if not args.tiny else 8
    print(f"\n[3] decoding: block {block}, one token per pass, prompt {args.prompt_tokens}, "
          f"{args.new_tokens} new tokens per sequence")
    print(f"{'batch':>5} {'tokens':>7} {'passes':>6} {'sec':>7} {'tok/s':>9} {'pass/s':>7} {'fwd%':>5}")
    for batch in (int(x) for x in args.batches.split(",")):
        tokens, passes, _, seconds, share = run_engine(
            built.model, batch=batch, block_size=block, steps_per_block=block,
            prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, device=device,
        )
        print(f"{batch:>5} {tokens:>7} {passes:>6} {seconds:>7.2f} {tokens / seconds:>9.1f} "
              f"{passes / seconds:>7.1f} {100 * share:>5.1f}", flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tiny", action="store_true", help="reduced shape: a CPU check of the script")
    parser.add_argument("--parts", default="1,2,3")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill tokens per iteration")
    parser.add_argument("--lengths", default="1024,4096,16384,32768,65536,131072")
    parser.add_argument("--torch-max", type=int, default=32768, help="longest length on the torch GDN path")
    parser.add_argument("--length-budget", type=float, default=60.0, help="stop a path past this many s")
    parser.add_argument("--long", type=int, default=32768)
    parser.add_argument("--shorts", type=int, default=20)
    parser.add_argument("--short-every", type=float, default=0.05)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --device cpu --tiny", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    config = clover_config(args.tiny)
    built = BuiltModel(build_random_clover(config, device=device, dtype=dtype), config)
    _sync(device)
    total, active = config.param_counts()
    params = sum(p.numel() for p in built.model.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}   torch {torch.__version__}   dtype: {args.dtype}   "
          f"build: {time.perf_counter() - started:.1f} s")
    print(f"model: {params / 1e9:.3f} B parameters built (config: {total / 1e9:.3f} B total, "
          f"{active / 1e9:.3f} B active), {config.num_hidden_layers} layers "
          f"({len(config.attention_layers)} attention), {config.num_experts} experts "
          f"top-{config.num_experts_per_tok}, vocab {config.vocab_size}")
    if device.type == "cuda":
        print(f"memory after build: {torch.cuda.memory_allocated(device) / 1e9:.1f} GB allocated")
    parts = {int(x) for x in args.parts.split(",")}
    if 1 in parts:  # no inference_mode around the engines: their threads update the caches in place
        part_prefill(built, args, device, dtype)
    if 2 in parts:
        part_short_jobs(built, args)
    if 3 in parts:
        part_decode(built, args, device)
    if device.type == "cuda":
        print(f"\npeak memory: {torch.cuda.max_memory_allocated(device) / 1e9:.1f} GB")
    print(f"total: {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
