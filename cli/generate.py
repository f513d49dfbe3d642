"""``cloverq generate``: offline generation through the same engine the workers run.

Loads a checkpoint, starts an engine with one slot, submits one request and prints the text
(or, with ``--json``, a JSON object as the last stdout line). Useful for trying a checkpoint and
for scripts; it exercises exactly the worker's decoding path. Every decoding flag not given takes
the checkpoint's ``generation_config.json`` value, else the model family's default
(``worker.model.family.decoding_defaults``); the dtype is ``--dtype``, else ``CLOVERQ_DTYPE``, else
the checkpoint's. A checkpoint that cannot be loaded is one line on stderr, exit 1.

It loads the model on one device: ``CLOVERQ_TENSOR_PARALLEL`` is a worker setting (rank processes,
their group and their failure handling belong to a worker's life), so when it is above 1 the command
says on stderr that it ignores it rather than leaving the reader to believe the run was sharded.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

_TP_IGNORED = (
    "note: CLOVERQ_TENSOR_PARALLEL={n} is ignored: `cloverq generate` loads the model on one device "
    "(tensor parallelism applies to workers: `cloverq worker`)"
)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise click.BadParameter(f"--prompt-ids must be comma-separated integers: {exc}") from exc


@click.command("generate")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Checkpoint folder (default: CLOVERQ_MODEL_DIR, else the demo under the data dir).",
)
@click.option("--prompt", type=str, default=None, help="Prompt text (chat template applied unless --raw).")
@click.option(
    "--prompt-ids", type=str, default=None, help="Prompt as comma-separated token ids (used as is)."
)
@click.option("--raw", is_flag=True, help="Skip the chat template.")
@click.option("--max-new-tokens", type=int, default=None, help="Default: generation_config, else 128.")
@click.option("--block-size", type=int, default=None, help="Default: the checkpoint's block size.")
@click.option("--steps-per-block", type=int, default=None, help="Default: the model family's.")
@click.option("--strategy", type=click.Choice(["static", "dynamic"]), default=None,
              help="Default: the model family's.")
@click.option("--threshold", type=float, default=None, help="Dynamic strategy only. Default: the family's.")
@click.option("--temperature", type=float, default=None,
              help="0 = greedy. Default: generation_config, else 0.")
@click.option("--top-k", type=int, default=None, help="Default: generation_config's.")
@click.option("--top-p", type=float, default=None, help="Default: generation_config's.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--step-budget", type=int, default=None, help="Max denoising passes for the request.")
@click.option("--thinking", is_flag=True, help="Enable thinking in the chat template.")
@click.option("--device", type=str, default=None, help="torch device (default: settings).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object as the last stdout line.")
def generate(
    model_dir: Path | None,
    prompt: str | None,
    prompt_ids: str | None,
    raw: bool,
    max_new_tokens: int | None,
    block_size: int | None,
    steps_per_block: int | None,
    strategy: str | None,
    threshold: float | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int,
    step_budget: int | None,
    thinking: bool,
    device: str | None,
    dtype: str | None,
    as_json: bool,
) -> None:
    """Generate from one prompt with the block-diffusion engine."""
    import torch

    from cli.model import existing_folder, model_errors, one_line
    from scheduler.infra.settings import get_settings
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.types import FinishReason, GenerationRequest, SamplingParams
    from worker.model.family import decoding_defaults
    from worker.model.hf_defaults import GenerationDefaults
    from worker.model.loader import load_model

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    settings = get_settings()
    folder = model_dir or settings.resolved_model_dir
    hint = "" if model_dir or settings.model.dir else (
        f" (the demo's place under the data dir: `cloverq model init-demo {folder}` writes it; or give "
        "--model / CLOVERQ_MODEL_DIR)"
    )
    existing_folder(folder, hint=hint)
    if settings.engine.tensor_parallel > 1:
        click.echo(_TP_IGNORED.format(n=settings.engine.tensor_parallel), err=True)
    began = time.perf_counter()
    dtype_name = dtype or settings.model.dtype
    try:
        lm = load_model(  # load_checkpoint, then CLOVERQ_WEIGHT_DTYPE's quantization (as a worker)
            folder,
            device=device or settings.model.device,
            dtype=getattr(torch, dtype_name) if dtype_name else None,
            verify=False if settings.model.skip_verify else settings.model.verify_on_load,
            weight_dtype=settings.model.weight_dtype,
            group_size=settings.model.weight_group_size,
        )
        load_seconds = time.perf_counter() - began
        tok = lm.tokenizer
        if prompt_ids is not None:
            ids = _parse_ids(prompt_ids)
        elif raw:
            ids = tok.encode(prompt or "")
        else:
            rendered = tok.render_chat([{"role": "user", "content": prompt or ""}], enable_thinking=thinking)
            ids = tok.encode(rendered)
    except model_errors() as exc:
        raise click.ClickException(one_line(exc)) from None
    gen = GenerationDefaults.from_dict(lm.generation_config)
    max_new_tokens = max_new_tokens or gen.max_new_tokens or 128
    temperature = temperature if temperature is not None else (gen.temperature or 0.0)
    default_block = block_size or lm.config.block_size or decoding_defaults(lm.config).block_size
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=1, max_len=max(len(ids) + max_new_tokens + default_block, 64)),
        mask_token_id=tok.mask_token_id,
        eos_token_ids=tok.eos_token_ids,
        default_block_size=default_block,
    )
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        steps_per_block=steps_per_block or gen.steps_per_block,
        strategy=strategy,  # type: ignore[arg-type]
        threshold=threshold if threshold is not None else gen.threshold,
        temperature=temperature,
        top_k=top_k if top_k is not None else gen.top_k,
        top_p=top_p if top_p is not None else gen.top_p,
        seed=seed,
        step_budget=step_budget,
    )
    engine.start()
    try:
        result = engine.submit(GenerationRequest("cli", ids, params)).result()
    finally:
        engine.stop(drain=False)
    text = tok.decode(result.token_ids, skip_special_tokens=True)
    if as_json:
        run = result.run_seconds
        payload = {
            "token_ids": result.token_ids,
            "text": text,
            "steps_used": result.steps_used,
            "finish_reason": str(result.finish_reason),
            "blocks": result.blocks,
            "tokens": result.tokens,
            "prompt_tokens": result.prompt_tokens,
            "error": result.error,
            "timings": {
                "load_seconds": round(load_seconds, 4),
                "queue_seconds": round(result.queue_seconds, 4),
                "run_seconds": round(run, 4),
                "tokens_per_second": round(result.tokens / run, 2) if run > 0 else None,
            },
        }
        click.echo(json.dumps(payload, ensure_ascii=False))
    else:
        click.echo(text)
        click.echo(
            f"[{result.finish_reason}] {result.tokens} tokens, {result.steps_used} passes, "
            f"{result.blocks} blocks, {result.run_seconds:.3f}s",
            err=True,
        )
    if result.finish_reason is FinishReason.ERROR:
        click.echo(f"error: {result.error}", err=True)
        sys.exit(1)


def register(group: click.Group) -> None:
    """Add ``generate`` to the root CLI."""
    group.add_command(generate)
