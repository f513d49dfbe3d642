"""``cloverq model ...``: write the demo checkpoint, verify a checkpoint folder, write its manifest,
plan a deployment.

Every refusal (a missing folder, a bad or missing manifest, an unsupported config) is one line on
stderr and exit 1, never a traceback: the ``model`` group catches the model package's errors.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from scheduler.fleet.sequence_memory import GDN_STATE_COPIES, gdn_state_bytes


def model_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "this checkpoint cannot be used" (each carries a one-line reason)."""
    from worker.model.checkpoint import CheckpointError
    from worker.model.config import ConfigError
    from worker.model.manifest import ManifestError
    from worker.model.tokenizer import TokenizerError

    return (CheckpointError, ConfigError, ManifestError, TokenizerError, OSError)


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (no traceback, no repeated whitespace)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def existing_folder(path: Path, *, what: str = "checkpoint folder", hint: str = "") -> Path:
    """``path`` if it is a folder, else a one-line ``ClickException``."""
    if not path.exists():
        raise click.ClickException(f"{what} {path} does not exist{hint}")
    if not path.is_dir():
        raise click.ClickException(f"{what} {path} is not a folder")
    return path


class ByteProgress:
    """Bytes and rate on stderr while files are copied or hashed: a line when a file is done and
    at most one every ``interval`` seconds in between."""

    def __init__(self, verb: str, total: int | None = None, *, interval: float = 2.0) -> None:
        self.verb, self.total, self.interval = verb, total, interval
        self.done = 0
        self.began = self._last = time.monotonic()
        self._file: str | None = None
        self._file_bytes = 0

    def plan(self, files: dict[str, int | None]) -> None:
        self.total = sum(size or 0 for size in files.values())
        click.echo(f"{self.verb} {len(files)} files, {_gb(self.total)}", err=True)

    def __call__(self, relpath: str, nbytes: int) -> None:
        if relpath != self._file:
            self._flush_file()
            self._file, self._file_bytes = relpath, 0
        self.done += nbytes
        self._file_bytes += nbytes
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            click.echo(f"  {self._status(now)}  {relpath} ...", err=True)

    def _status(self, now: float) -> str:
        rate = self.done / max(now - self.began, 1e-9)
        total = f" / {_gb(self.total)} ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return f"{_gb(self.done)}{total}  {rate / 1e6:.0f} MB/s"

    def _flush_file(self) -> None:
        if self._file is not None:
            status = self._status(time.monotonic())
            click.echo(f"  {status}  {self._file} ({_gb(self._file_bytes)})", err=True)
            self._file = None

    def finish(self) -> None:
        self._flush_file()


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def guarded(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run a command, turning the model package's errors into one-line ``ClickException``s."""
    import functools

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except model_errors() as exc:
            raise click.ClickException(one_line(exc)) from None

    return run


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
    type=click.Choice(["clover", "sdar", "llada2"]),
    default="clover",
    show_default=True,
    help="clover: the Qwen3.5-MoE hybrid trunk with block-diffusion previews; sdar: SDAR-MoE (Qwen3-MoE); "
    "llada2: LLaDA2-MoE (BailingMoeV2).",
)
def init_demo(directory: Path, seed: int, size: str, arch: str) -> None:
    """Write a deterministic demo checkpoint (random weights) into DIRECTORY."""
    from worker.model.demo import write_demo_checkpoint

    folder = write_demo_checkpoint(directory, seed=seed, size=size, arch=arch)  # type: ignore[arg-type]
    click.echo(f"wrote {size} {arch} demo checkpoint (seed {seed}) to {folder}")


@click.command("verify")
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@click.option(
    "--reference",
    "reference_dir",
    type=click.Path(path_type=Path),
    help="A checkpoint folder shipping its own modeling code (auto_map): build a tiny random model "
    "from that code and compare its causal logits with ours on the same weights.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the --reference check.")
@click.option(
    "--tolerance", type=float, default=1e-4, show_default=True, help="Largest logit difference that passes."
)
@click.option(
    "--quick", is_flag=True,
    help="Sizes and sampled chunks only (what a worker checks at load), not every byte.",
)
@guarded
def verify(directory: Path | None, reference_dir: Path | None, seed: int, tolerance: float,
           quick: bool) -> None:
    """Check DIRECTORY against its manifest.json (every byte); exit 1 naming every bad or missing file.

    With --reference DIR: check our causal trunk (and block commits) against DIR's own modeling
    code on a tiny random model; prints the largest logit difference, exit 1 on FAIL, exit 2 when
    the check cannot run (e.g. DIR has no auto_map).
    """
    if directory is None and reference_dir is None:
        raise click.UsageError("give DIRECTORY (manifest check) and/or --reference DIR")
    if directory is not None:
        from worker.model.manifest import MANIFEST_NAME, check, missing_manifest_message

        existing_folder(directory)
        progress = None if quick else ByteProgress("verifying")
        report = check(directory, mode="quick" if quick else "full", on_progress=progress)
        if progress is not None:
            progress.finish()
        if [(p.path, p.reason) for p in report.problems] == [(MANIFEST_NAME, "missing")]:
            raise click.ClickException(missing_manifest_message(directory))
        if report.problems:
            for problem in report.problems:
                click.echo(f"BAD  {problem}", err=True)
            sys.exit(1)
        click.echo(f"OK   {directory} ({report.summary()})")
    if reference_dir is not None:
        _verify_reference(existing_folder(reference_dir), seed=seed, tolerance=tolerance)


@click.command("manifest")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace an existing manifest.json.")
@guarded
def manifest_command(directory: Path, force: bool) -> None:
    """Hash every file of DIRECTORY once and write its manifest.json in place.

    For a checkpoint served from its own folder (CLOVERQ_MODEL_DIR); `cloverq model pull` writes
    the manifest of a store version itself. An existing manifest is kept (it may be the record
    that proves the files intact) unless --force.
    """
    from worker.model.manifest import MANIFEST_NAME, checkpoint_files, write_manifest

    existing_folder(directory)
    if (directory / MANIFEST_NAME).exists() and not force:
        raise click.ClickException(
            f"{directory / MANIFEST_NAME} exists: `cloverq model verify {directory}` checks the files "
            "against it; --force replaces it"
        )
    files = checkpoint_files(directory)
    if not files:
        raise click.ClickException(f"{directory} holds no files")
    progress = ByteProgress("hashing")
    progress.plan({rel: (directory / rel).stat().st_size for rel in files})
    digest = write_manifest(directory, on_progress=progress)
    progress.finish()
    click.echo(f"wrote {directory / MANIFEST_NAME}: {len(files)} files, manifest sha256 {digest[:12]}")


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
_DEFAULT_STATE_BYTES = GDN_STATE_COPIES * gdn_state_bytes(
    layers=30, value_heads=32, key_head_dim=128, value_head_dim=128, conv_channels=8192, conv_kernel=4)


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
    type=click.Path(path_type=Path),
    help="Take shapes and parameter counts from a checkpoint folder's config.json.",
)
@click.option(
    "--check",
    "check_dir",
    type=click.Path(path_type=Path),
    help="Also load this checkpoint on the CPU (quantized with --weight-dtype), report its measured "
    "parameter + buffer bytes next to the planner's prediction (implies --config DIR).",
)
@click.option(
    "--weight-dtype",
    type=click.Choice(["int8", "int4"]),
    help="--check: quantize as CLOVERQ_WEIGHT_DTYPE does [the --dtype row when it is int8/int4].",
)
@click.option(
    "--group-size", type=click.Choice(["32", "64", "128"]), default="64", show_default=True,
    help="int4 group (CLOVERQ_WEIGHT_GROUP_SIZE) of the int4 row and of --check.",
)
@click.option(
    "--tensor-parallel", type=click.IntRange(min=1), default=1, show_default=True,
    help="Also print each rank's weight bytes for a worker over N devices (CLOVERQ_TENSOR_PARALLEL; "
    "needs --config DIR).",
)
@guarded
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
    check_dir: Path | None,
    weight_dtype: str | None,
    group_size: str,
    tensor_parallel: int,
) -> None:
    """Weight and KV-cache memory, compute per token, and GPUs needed to serve a model."""
    from scheduler.infra.settings import get_settings
    from worker.model.planner import (
        BYTES_PER_PARAM,
        PlanInput,
        format_plan,
        format_rank_weight_bytes,
        plan,
        plan_rank_weight_bytes,
        plan_weight_bytes,
    )

    shape = dict(_DEFAULT_SHAPE)
    state_bytes = float(_DEFAULT_STATE_BYTES)
    weights: dict[str, float] = {}
    config_dir = config_dir or check_dir
    if tensor_parallel > 1 and config_dir is None:  # a rank's share follows the checkpoint's shapes
        raise click.UsageError("--tensor-parallel needs --config DIR (the split follows its shapes)")
    rank_rows: dict[str, list[int]] = {}
    if config_dir is not None:
        from worker.model.checkpoint import read_config

        config = read_config(existing_folder(config_dir))
        total, active = config.param_counts()
        shape = {
            "layers": len(config.attention_layers),
            "attention_heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
        }
        state_bytes = float(config.sequence_memory(BYTES_PER_PARAM[kv_dtype]).state_bytes)
        if total_params is None:  # exact bytes per row: quantized matrices + what stays high precision
            weights = plan_weight_bytes(config, dtype, group_size=int(group_size))
        total_params = total_params or total
        active_params = active_params or active
        if tensor_parallel > 1:  # raises ShardError (one line, via guarded) when the shapes do not split
            rank_rows = plan_rank_weight_bytes(config, dtype, world=tensor_parallel,
                                               group_size=int(group_size))
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
        prefix_cache_bytes=float(get_settings().engine.prefix_cache_bytes),
        weight_bytes=weights,
        **shape,
    )
    click.echo(format_plan(plan(inp)))
    if rank_rows:
        click.echo("")
        click.echo(format_rank_weight_bytes(tensor_parallel, rank_rows))
    if check_dir is not None:
        _check_weights(check_dir, weight_dtype or (dtype if dtype in ("int8", "int4") else None),
                       int(group_size), dtype)


def _check_weights(folder: Path, weight_dtype: str | None, group_size: int, dtype: str) -> None:
    """``plan --check``: the checkpoint's measured bytes after load (and quantization) vs the plan's."""
    import torch

    from worker.model.weight_check import check_checkpoint

    floats = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    result = check_checkpoint(existing_folder(folder), weight_dtype=weight_dtype, group_size=group_size,
                              dtype=floats.get(dtype))
    click.echo("")
    for line in result.lines():
        click.echo(line)


def register(group: click.Group) -> None:
    """Add the ``model`` group (init-demo, verify, plan) to the root CLI."""
    model = model_group(group)
    model.add_command(init_demo)
    model.add_command(verify)
    model.add_command(manifest_command)
    model.add_command(plan_command)
