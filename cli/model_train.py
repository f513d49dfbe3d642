"""``cloverq model train-demo``: train the tiny demo checkpoint on the synthetic contract corpus.

The trainer is ``worker.training.trainer`` (CPU, the engine's block-diffusion objective); this
command adds the progress bar and the defaults of the shipped checkpoint
(``models/clover-demo``: ``cloverq model train-demo models/clover-demo``). Interrupted or stopped
by ``--max-minutes``, the same command resumes from the folder's ``resume.pt``. It pins the
process's float path first (``worker.training.float_path``), so that the bytes should not depend
on which x86-64 CPU ran it (shown on one machine only).
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from cli.model import guarded, model_group, one_line
from worker.training.questions import GROUPS


@click.command("train-demo")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(["clover", "sdar"]), default="clover", show_default=True)
@click.option("--steps", type=int, default=1500, show_default=True, help="Optimizer steps in all.")
@click.option("--batch", type=int, default=16, show_default=True, help="Rows per step.")
@click.option("--lr", type=float, default=3e-3, show_default=True, help="Peak learning rate (AdamW).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the initial weights, the tokenizer's corpus, every batch.")  # fmt: skip
@click.option("--save-every", type=int, default=100, show_default=True, help="Steps between resume points.")
@click.option("--max-minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop after this long (saving a resume point); run again to continue.")  # fmt: skip
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch threads: on one float path the same count repeats the same bytes, "
                   "another count gives others (the threads split each sum).")  # fmt: skip
@click.option("--native-float-path", is_flag=True, default=False,
              help="Compute on this CPU's widest kernels (about 10% faster) instead of the pinned "
                   "AVX2 path; the bytes then depend on the machine.")  # fmt: skip
@click.option("--cpu-model-float-path", is_flag=True, default=False,
              help="Pin ATen to AVX2 and MKL to its own branch for this CPU model (MKL_CBWR=AUTO,STRICT) "
                   "instead of the portable pin: the same bytes on the same CPU model, about 1.5x as "
                   "fast on an AMD EPYC, where the portable pin runs MKL's SSE2 branch.")  # fmt: skip
@click.option("--init-from", type=click.Path(exists=True, file_okay=False), default=None,
              help="Start from this trained demo (weights, tokenizer), not random weights.")  # fmt: skip
@click.option("--decision-share", type=float, default=0.6, show_default=True,
              help="Share of a step's rows that are decisions (the rest: generation rows).")  # fmt: skip
@click.option("--served-slots", is_flag=True, default=False,
              help="Noise decision rows as the engine serves them: a choice slot masked whole, a slot "
                   "crossing a block boundary masked in the earlier block too.")  # fmt: skip
@click.option("--decision-weight", type=float, default=None,
              help="Loss weight of a decision row's targets (default 1).")  # fmt: skip
@click.option("--parallel-slots", type=float, default=None,
              help="Share of joint decision rows with all choice slots masked in one pass.")  # fmt: skip
@click.option("--groups", type=int, default=None,
              help="Question groups per training contract (default: one or two, as evaluated).")  # fmt: skip
@click.option("--easy-steps", type=int, default=None,
              help="First steps: decision rows only a group's first question, asked alone.")  # fmt: skip
@click.option("--buckets", type=int, default=None,
              help="Passes per step over rows of like length, logits only at targets (faster).")  # fmt: skip
@click.option("--hidden", type=int, default=None,
              help="Hidden size of the random start (default the tiny demo's 64).")  # fmt: skip
@click.option("--layers", type=int, default=None,
              help="Layers of the random start, GDN and attention alternating (default 4).")  # fmt: skip
@click.option("--layer-pattern", default=None,
              help="Clover layer types of the random start: L (GDN) / A (attention) letters repeated "
                   "over the layers (default LA; A: attention only).")  # fmt: skip
@click.option("--headings", is_flag=True, default=False,
              help="Contracts with section headings that the questions repeat (evaluate with "
                   "bench.demo_quality --headings).")  # fmt: skip
@click.option("--vocab", type=int, default=None,
              help="Size of the corpus-trained tokenizer (default 512; the BPE stops at the "
                   "corpus's last merge).")  # fmt: skip
@click.option("--value-share", type=float, default=None,
              help="Share of decision rows asking a value question instead (\"Which law "
                   "governs?\").")  # fmt: skip
@click.option("--extract-share", type=float, default=None,
              help="Share of decision rows that are extraction rows instead (an extract job's "
                   "schema canvas).")  # fmt: skip
@click.option("--tool-share", type=float, default=None,
              help="Share of generation rows that are tool-call rows instead (a chat with tools "
                   "on offer: the call to make, or a one-line answer); a fresh run's tokenizer "
                   "learns them too.")  # fmt: skip
@click.option("--tool-keys", type=float, default=None,
              help="Weigh the tokens that decide a tool call (the first answer token, the "
                   "function's name, the argument's value) this much, and noise half the tool rows "
                   "at a block holding one (needs --buckets and --tool-share).")  # fmt: skip
@click.option("--joint-share", type=float, default=None,
              help="Share of the question decision rows asked jointly (default: half).")  # fmt: skip
@click.option("--self-distill", type=int, default=None,
              help="A stage (--init-from) whose generation rows are that checkpoint's own answers "
                   "to this many training cases, decoded one token per pass: more tokens per pass "
                   "under dynamic decoding.")  # fmt: skip
@click.option("--cached-pool", is_flag=True, default=False,
              help="Decode --self-distill's pool with the committed tokens in a cache, as the engine "
                   "does (the same passes, about 3x as fast; Clover), not every pass over the "
                   "whole prompt.")  # fmt: skip
@click.option("--wide-phrasings", is_flag=True, default=False,
              help="Training contracts in six wordings of each clause instead of three (the "
                   "held-out wording still unseen); a fresh run's tokenizer reads them too.")  # fmt: skip
@click.option("--focus-kind", type=click.Choice(sorted(GROUPS)), default=None,
              help="Oversample this question kind (with --focus-share and/or --focus-steps): "
                   "rows asking it about contracts of their own.")  # fmt: skip
@click.option("--focus-share", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
              help="Share of the decision rows that are --focus-kind rows (besides the kind's "
                   "rows in the mix; half ask its value question).")  # fmt: skip
@click.option("--focus-steps", type=click.IntRange(min=1), default=None,
              help="The first steps: every row a --focus-kind row (a curriculum).")
@click.option("--focus-joint", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
              help="Share of the --focus-kind rows that ask its group's two questions jointly "
                   "instead of one alone.")  # fmt: skip
@click.option("--chain-blocks", type=click.IntRange(min=2), default=None,
              help="Train each generation or tool row over up to this many consecutive answer "
                   "blocks per step, one short pass per further block against the first pass's "
                   "cache (Clover; needs --buckets).")  # fmt: skip
@click.option("--certainty", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Weight of a certainty-forcing term: the entropy of a generation or tool row's "
                   "prediction where its argmax is already right, added to the loss, so dynamic "
                   "decoding finds more positions sure (needs --buckets).")  # fmt: skip
@click.option("--ema", type=click.FloatRange(min=0, max=1, min_open=True, max_open=True), default=None,
              help="Write an exponential moving average of the weights (this decay per step, "
                   "e.g. 0.998) instead of the last step's; training itself is unchanged.")  # fmt: skip
@click.option("--block-size", type=int, default=None,
              help="Block size of the random start (default the demo's 4), or with --init-from of the "
                   "stage (default the starting checkpoint's).")  # fmt: skip
@guarded
def train_demo_command(
    init_from: str | None,
    decision_share: float,
    served_slots: bool,
    decision_weight: float | None,
    parallel_slots: float | None,
    groups: int | None,
    easy_steps: int | None,
    buckets: int | None,
    hidden: int | None,
    layers: int | None,
    layer_pattern: str | None,
    headings: bool,
    vocab: int | None,
    value_share: float | None,
    extract_share: float | None,
    tool_share: float | None,
    tool_keys: float | None,
    joint_share: float | None,
    block_size: int | None,
    self_distill: int | None,
    cached_pool: bool,
    wide_phrasings: bool,
    focus_kind: str | None,
    focus_share: float | None,
    focus_steps: int | None,
    focus_joint: float | None,
    chain_blocks: int | None,
    certainty: float | None,
    ema: float | None,
    directory: Path,
    arch: str,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    save_every: int,
    max_minutes: float | None,
    threads: int,
    native_float_path: bool,
    cpu_model_float_path: bool,
) -> None:
    """Train the tiny demo (ARCH) into DIRECTORY, resuming from DIRECTORY/resume.pt if present."""
    import torch

    from worker.training.float_path import FloatPathError, float_path, pin_float_path
    from worker.training.trainer import RESUME_FILE, TrainConfig, TrainConfigError, check_config, train_demo

    config = TrainConfig(arch=arch, steps=steps, batch=batch, lr=lr, seed=seed,  # type: ignore[arg-type]
                         save_every=save_every, init_from=init_from, decision_share=decision_share,
                         served_slots=served_slots or None, decision_weight=decision_weight,
                         parallel_slots=parallel_slots, groups=groups, easy_steps=easy_steps, buckets=buckets,
                         hidden=hidden, layers=layers, layer_pattern=layer_pattern,
                         headings=headings or None, vocab=vocab, value_share=value_share,
                         block_size=block_size, extract_share=extract_share,
                         tool_share=tool_share, tool_keys=tool_keys, joint_share=joint_share,
                         self_distill=self_distill, cached_pool=cached_pool or None,
                         wide_phrasings=wide_phrasings or None,
                         focus_kind=focus_kind, focus_share=focus_share, focus_steps=focus_steps,
                         focus_joint=focus_joint, chain_blocks=chain_blocks, certainty=certainty,
                         ema=ema)  # fmt: skip
    try:
        check_config(config)  # a usage mistake is told before anything else happens
    except TrainConfigError as exc:
        raise click.UsageError(one_line(exc)) from None
    if native_float_path and cpu_model_float_path:
        raise click.UsageError("--native-float-path and --cpu-model-float-path are two float paths: one or "
                               "the other")  # fmt: skip
    if not native_float_path:  # before the first kernel: ATen's and MKL's kernels not chosen by the CPU
        try:
            pin_float_path(cpu_model=cpu_model_float_path)
        except FloatPathError as exc:
            raise click.ClickException(one_line(exc)) from None
    torch.set_num_threads(threads)
    if (directory / RESUME_FILE).is_file():
        click.echo(f"resuming from {directory / RESUME_FILE}", err=True)
    columns = (TextColumn("[bold]train-demo"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"),
               TimeElapsedColumn(), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns) as bar:
        task = bar.add_task("train", total=steps, loss="-")

        def progress(step: int, loss: float) -> None:
            bar.update(task, completed=step, loss=f"{loss:.3f}")

        budget = None if max_minutes is None else max_minutes * 60
        try:
            result = train_demo(directory, config, max_seconds=budget, progress=progress)
        except TrainConfigError as exc:  # options that cannot go together, or another run's resume point
            raise click.UsageError(one_line(exc)) from None
    state = (
        "done"
        if result.finished
        else f"stopped (resume: run the same command; {RESUME_FILE} is in {directory})"
    )
    path = float_path()
    click.echo(f"{state}: {result.steps}/{steps} steps, {result.seconds:.0f} s this run, "
               f"loss {result.first_loss:.3f} -> {result.final_loss:.3f} (mean of the last 50 steps), "
               f"float path {path['aten']} / MKL {path['mkl_cbwr']}")  # fmt: skip


def register(group: click.Group) -> None:
    model_group(group).add_command(train_demo_command)
