"""``cloverq generate``: offline generation through the same engine the workers run.

Loads a checkpoint, starts an engine with one slot, submits one request and prints the text
(or, with ``--json``, a JSON object as the last stdout line). Useful for trying a checkpoint and
for scripts; it exercises exactly the worker's decoding path.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise click.BadParameter(f"--prompt-ids must be comma-separated integers: {exc}") from exc


@click.command("generate")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint folder (default: the configured model dir).",
)
@click.option("--prompt", type=str, default=None, help="Prompt text (chat template applied unless --raw).")
@click.option(
    "--prompt-ids", type=str, default=None, help="Prompt as comma-separated token ids (used as is)."
)
@click.option("--raw", is_flag=True, help="Skip the chat template.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--block-size", type=int, default=None, help="Default: the checkpoint's block size.")
@click.option("--steps-per-block", type=int, default=4, show_default=True)
@click.option("--strategy", type=click.Choice(["static", "dynamic"]), default="static", show_default=True)
@click.option("--threshold", type=float, default=0.9, show_default=True, help="Dynamic strategy only.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
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
    max_new_tokens: int,
    block_size: int | None,
    steps_per_block: int,
    strategy: str,
    threshold: float,
    temperature: float,
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

    from scheduler.settings import get_settings
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.types import FinishReason, GenerationRequest, SamplingParams
    from worker.model.checkpoint import load_checkpoint

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    settings = get_settings()
    folder = model_dir or settings.resolved_model_dir
    began = time.perf_counter()
    lm = load_checkpoint(
        folder,
        device=device or settings.device,
        dtype=getattr(torch, dtype or settings.dtype),
        verify=not settings.skip_verify,
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
    default_block = block_size or lm.config.block_size or 4
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
        steps_per_block=steps_per_block,
        strategy=strategy,  # type: ignore[arg-type]
        threshold=threshold,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
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
