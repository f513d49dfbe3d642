"""``cloverq model ...``: write the demo checkpoint, verify a checkpoint folder, plan a deployment."""

from __future__ import annotations

import sys
from pathlib import Path

import click


def model_group(group: click.Group) -> click.Group:
    """The ``model`` group, created on first use; every ``cloverq model ...`` module adds to it."""
    existing = group.commands.get("model")
    if isinstance(existing, click.Group):
        return existing

    @group.group("model")
    def model() -> None:
        """Checkpoints and model versions: demo, verify, plan, pull, list, activate, rollback."""

    return model


@click.command("init-demo")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True)
@click.option(
    "--arch",
    type=click.Choice(["clover", "sdar"]),
    default="clover",
    show_default=True,
    help="clover: the Qwen3.5-MoE hybrid trunk with block-diffusion previews; sdar: SDAR-MoE (Qwen3-MoE).",
)
def init_demo(directory: Path, seed: int, size: str, arch: str) -> None:
    """Write a deterministic demo checkpoint (random weights) into DIRECTORY."""
    from worker.model.demo import write_demo_checkpoint

    folder = write_demo_checkpoint(directory, seed=seed, size=size, arch=arch)  # type: ignore[arg-type]
    click.echo(f"wrote {size} {arch} demo checkpoint (seed {seed}) to {folder}")


@click.command("verify")
@click.argument("directory", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--reference",
    "reference_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A checkpoint folder shipping its own modeling code (auto_map): build a tiny random model "
    "from that code and compare its causal logits with ours on the same weights.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the --reference check.")
@click.option(
    "--tolerance", type=float, default=1e-4, show_default=True, help="Largest logit difference that passes."
)
def verify(directory: Path | None, reference_dir: Path | None, seed: int, tolerance: float) -> None:
    """Check DIRECTORY against its manifest.json; exit 1 naming every bad or missing file.

    With --reference DIR: check our causal trunk (and block commits) against DIR's own modeling
    code on a tiny random model; prints the largest logit difference, exit 1 on FAIL, exit 2 when
    the check cannot run (e.g. DIR has no auto_map).
    """
    if directory is None and reference_dir is None:
        raise click.UsageError("give DIRECTORY (manifest check) and/or --reference DIR")
    if directory is not None:
        from worker.model.manifest import check_manifest

        problems = check_manifest(directory)
        if problems:
            for problem in problems:
                click.echo(f"BAD  {problem}", err=True)
            sys.exit(1)
        click.echo(f"OK   {directory}")
    if reference_dir is not None:
        _verify_reference(reference_dir, seed=seed, tolerance=tolerance)


def _verify_reference(folder: Path, *, seed: int, tolerance: float) -> None:
    from worker.model.reference_check import (
        NoRemoteCodeError,
        ReferenceCheckError,
        ReferenceMismatchError,
        check_reference,
    )

    try:
        result = check_reference(folder, seed=seed, tolerance=tolerance)
    except NoRemoteCodeError as exc:
        click.echo(f"SKIP {exc}", err=True)
        sys.exit(2)
    except ReferenceMismatchError as exc:
        click.echo(f"FAIL {exc}", err=True)
        sys.exit(1)
    except ReferenceCheckError as exc:
        click.echo(f"ERROR {exc}", err=True)
        sys.exit(2)
    for line in result.lines():
        click.echo(line)
    if not result.passed:
        sys.exit(1)


# Clover-35B-A3B-Preview's shape when neither flags nor --config say: 10 of its 40 layers keep K/V
# (16 q heads, 2 KV heads x 256); its 30 Gated DeltaNet layers hold, per sequence, 32 heads x 128 x
# 128 float32 states and a 3-row ring of 8192 channels, in two copies.
_DEFAULT_SHAPE = {"layers": 10, "attention_heads": 16, "kv_heads": 2, "head_dim": 256}
_DEFAULT_STATE_BYTES = 2 * 30 * (32 * 128 * 128 * 4 + 3 * 8192 * 4)


@click.command("plan")
@click.option("--total-params", type=float, help="Total parameters (all experts), e.g. 35e9.")
@click.option("--active-params", type=float, help="Parameters active per token, e.g. 3e9.")
@click.option(
    "--dtype", type=click.Choice(["fp32", "bf16", "fp16", "int8", "int4"]), default="bf16", show_default=True
)
@click.option(
    "--kv-dtype", type=click.Choice(["fp32", "bf16", "fp16", "int8"]), default="bf16", show_default=True
)
@click.option("--context", type=int, default=32768, show_default=True, help="Positions per sequence.")
@click.option("--batch", type=int, default=64, show_default=True, help="Concurrent sequences.")
@click.option("--layers", type=int, help=f"Decoder layers [{_DEFAULT_SHAPE['layers']}].")
@click.option("--attention-heads", type=int, help=f"Query heads [{_DEFAULT_SHAPE['attention_heads']}].")
@click.option("--kv-heads", type=int, help=f"Key/value heads [{_DEFAULT_SHAPE['kv_heads']}].")
@click.option("--head-dim", type=int, help=f"Head dimension [{_DEFAULT_SHAPE['head_dim']}].")
@click.option(
    "--gpu-memory", type=float, default=141.0, show_default=True, help="GiB per GPU of your choice."
)
@click.option("--headroom", type=click.FloatRange(1.3, 1.5), default=1.4, show_default=True)
@click.option(
    "--config",
    "config_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Take shapes and parameter counts from a checkpoint folder's config.json.",
)
def plan_command(
    total_params: float | None,
    active_params: float | None,
    dtype: str,
    kv_dtype: str,
    context: int,
    batch: int,
    layers: int | None,
    attention_heads: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    gpu_memory: float,
    headroom: float,
    config_dir: Path | None,
) -> None:
    """Weight and KV-cache memory, compute per token, and GPUs needed to serve a model."""
    from worker.model.planner import PlanInput, format_plan, plan

    shape = dict(_DEFAULT_SHAPE)
    state_bytes = float(_DEFAULT_STATE_BYTES)
    if config_dir is not None:
        from worker.model.checkpoint import read_config

        config = read_config(config_dir)
        total, active = config.param_counts()
        shape = {
            "layers": len(config.attention_layers),
            "attention_heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
        }
        state_bytes = 2.0 * config.gdn_state_bytes()
        total_params = total_params or total
        active_params = active_params or active
    if total_params is None or active_params is None:
        raise click.UsageError("give --total-params and --active-params, or --config DIR")
    given = {"layers": layers, "attention_heads": attention_heads, "kv_heads": kv_heads, "head_dim": head_dim}
    shape.update({k: v for k, v in given.items() if v is not None})
    inp = PlanInput(
        total_params=total_params,
        active_params=active_params,
        dtype=dtype,
        kv_dtype=kv_dtype,
        context=context,
        batch=batch,
        gpu_memory_gib=gpu_memory,
        headroom=headroom,
        state_bytes_per_sequence=state_bytes,
        **shape,
    )
    click.echo(format_plan(plan(inp)))


def register(group: click.Group) -> None:
    """Add the ``model`` group (init-demo, verify, plan) to the root CLI."""
    model = model_group(group)
    model.add_command(init_demo)
    model.add_command(verify)
    model.add_command(plan_command)
