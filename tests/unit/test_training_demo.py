"""The demo trainer: rows as the engine builds them; a short run is bit-for-bit repeatable and
resumes to the same bytes; the shipped trained checkpoint loads with its special tokens."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from tests.unit.wide_openings import EXTRA_OPENINGS
from worker.decisions.planner import plan_decision
from worker.engine.types import SamplingParams
from worker.model.checkpoint import SINGLE_NAME, load_checkpoint
from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.model.hf_defaults import GenerationDefaults
from worker.model.tokenizer import Tokenizer
from worker.sampler.layout import build_layout
from worker.sampler.sequence import SequenceState
from worker.training.corpus import decision_case
from worker.training.rows import Row, decision_rows
from worker.training.trainer import (
    RESUME_FILE,
    TrainConfig,
    TrainConfigError,
    _batch,
    _noisy_batch,
    bucketed_loss,
    declare_joint_decode,
    denoise,
    parallel_decision,
    served_decision,
    slot_blocks,
    train_demo,
)

# how each kind's value question opens (``worker.training.questions._value``)
VALUE_ASKS = ("Which law", "How many days", "How long", "What is the liability cap", "Within how many",
              "To whom")  # fmt: skip


def test_decision_rows_are_the_planner_prompts_with_the_true_choices_in_the_slots() -> None:
    tokenizer = Tokenizer.from_dir(TRAINED_CLOVER_DEMO)
    case = decision_case("train", 0, 3)
    rows = decision_rows(case, "joint", tokenizer, block=4)
    plan = plan_decision(case.spec("joint"), tokenizer, request_id="t", params=SamplingParams(),  # type: ignore[arg-type]
                         rationale_tokens=0, slot_class="x")  # fmt: skip
    prompt = list(plan.requests[0].prompt_ids)
    [row] = rows
    assert list(row.ids[: len(prompt)]) == prompt and not any(row.predicted[: len(prompt)])
    region = tokenizer.decode(list(row.ids[len(prompt) :]), skip_special_tokens=True)
    assert all(f'"choice": "{a}"' in region for a in case.answers)
    assert sum(row.predicted) >= len(case.answers) and len(row.ids) % 4 == 0
    assert len(decision_rows(case, "independent", tokenizer, block=4)) == len(case.answers)


def test_served_slots_noise_a_decision_row_as_the_engine_feeds_each_block_of_its_slot() -> None:
    """The engine masks a choice slot whole; a slot crossing a block boundary is only scored in
    its first block and stays MASK tokens in the committed prefix while its last block decides it.
    The training row of each of those blocks (``served_slots``) is exactly the engine's pass input
    (the first recipe showed the slot's earlier tokens in clear and masked a random share)."""
    tokenizer = Tokenizer.from_dir(TRAINED_CLOVER_DEMO)
    mask = tokenizer.token_id("<|mask|>")
    assert mask is not None
    crossing = 0
    for index in range(40):
        case = decision_case("train", 0, index)
        plan = plan_decision(case.spec("independent"), tokenizer, request_id="t",  # type: ignore[arg-type]
                             params=SamplingParams(), rationale_tokens=0, slot_class="x")  # fmt: skip
        for row, request in zip(
            decision_rows(case, "independent", tokenizer, block=4), plan.requests, strict=True
        ):
            [(start, length)] = row.units
            assert all(row.predicted[start : start + length])
            blocks = slot_blocks(row, 4)
            if len(blocks) < 2:
                continue
            crossing += 1
            request.params = SamplingParams(max_new_tokens=1, steps_per_block=4, strategy="static")
            layout = build_layout(request, 4, tokenizer.vocab_size, 4096)
            state = SequenceState.start(request, layout, block_size=4, mask_token_id=mask,
                                        eos_token_ids=frozenset(tokenizer.eos_token_ids))  # fmt: skip
            for n in blocks:
                assert state.block_index == n
                engine = state.pass_input()
                targets, hidden = served_decision(row, 4, n)
                for seed in range(200):  # a draw of the trainer's that picks block n
                    noisy, _, masked, commit, _ = _noisy_batch(
                        [row], 4, mask, torch.Generator().manual_seed(seed), served_slots=True
                    )
                    if int(commit[0]) == n * 4:
                        break
                assert int(commit[0]) == n * 4 and masked[0].nonzero().flatten().tolist() == targets
                # the engine's input of this block: the slot's earlier positions still masks
                assert (
                    noisy[0, engine.start_pos : engine.start_pos + len(engine.tokens)].tolist()
                    == engine.tokens
                )
                assert all(noisy[0, p] == mask for p in hidden) and len(hidden) == sum(
                    state.deferred[p - layout.region_start] for p in range(start, n * 4)
                )
                if n == blocks[-1]:  # the deciding block: every remaining slot position masked
                    assert masked[0, n * 4 : n * 4 + engine.block_len].tolist() == engine.masked
                    assert hidden
                else:  # a deferred block: only scored, with the slot's later blocks out of view
                    r0 = layout.region_start
                    assert targets == [p for p in range(max(n * 4, r0), n * 4 + 4) if state.deferred[p - r0]]
                    assert engine.quota == 0
                    for group in engine.groups:  # the runner's scores of the deferred positions
                        group.scores = [0.0] * len(group.candidates)
                    state.apply_pass(engine.tokens[-4:], [False] * 4, [(0, 0.0)] * len(engine.groups))
    assert crossing >= 10


def test_parallel_slots_mask_every_choice_slot_of_a_joint_row_in_one_pass() -> None:
    """``parallel_slots``: a joint row's pass starts at its first slot's block, runs to the end of
    its last slot's block, and every slot position (only those) is a target; rows with one slot
    stay served block by block. ``groups`` asks that many question groups per contract."""
    tokenizer = Tokenizer.from_dir(TRAINED_CLOVER_DEMO)
    mask = tokenizer.token_id("<|mask|>")
    assert mask is not None
    case = decision_case("train", 0, 5, groups=3)
    assert len(case.groups) == 3 and len({g.kind for g in case.groups}) == 3
    [row] = decision_rows(case, "joint", tokenizer, block=4)
    single = decision_rows(case, "independent", tokenizer, block=4)[0]
    first, last, targets = parallel_decision(row, 4)
    assert targets == [p for s, n in row.units for p in range(s, s + n)] and len(row.units) == 6
    noisy, clean, masked, commit, valid = _noisy_batch(
        [row, single], 4, mask, torch.Generator().manual_seed(0), served_slots=True, parallel_slots=1.0
    )
    assert int(commit[0]) == first * 4 and int(valid[0].sum()) == (last + 1) * 4
    assert masked[0].nonzero().flatten().tolist() == targets
    assert (noisy[0] == mask).nonzero().flatten().tolist() == targets
    assert (noisy[0][valid[0]] == clean[0][valid[0]]).sum() == int(valid[0].sum()) - len(targets)
    assert int(masked[1].sum()) <= single.units[0][1]  # one slot: the served pass


def test_the_bucketed_loss_is_the_one_pass_loss_and_easy_steps_ask_first_questions_alone() -> None:
    """``buckets``: passes over rows of like length with logits only at the targets give the
    weighted mean of one padded pass (up to float rounding); ``easy_steps``: a decision row of an
    early step is one group's first question asked alone."""
    torch.set_num_threads(1)
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    mask = lm.config.mask_token_id
    assert mask is not None
    config = TrainConfig(batch=6, decision_share=0.7, served_slots=True, parallel_slots=0.5, groups=2,
                         easy_steps=1)  # fmt: skip
    easy = [r for r in _batch(0, config, lm.tokenizer, 4) if r.units]
    assert easy and all(len(r.units) == 1 for r in easy)
    rows = _batch(1, config, lm.tokenizer, 4)
    noisy, clean, masked, commit, valid = _noisy_batch(rows, 4, mask, torch.Generator().manual_seed(1),
                                                       served_slots=True, parallel_slots=0.5)  # fmt: skip
    weight = torch.tensor([3.0 if r.units else 1.0 for r in rows])
    with torch.no_grad():
        logits = denoise(lm.model, noisy, commit, valid)
        w = weight[:, None].expand_as(masked)[masked]
        ce = torch.nn.functional.cross_entropy(logits[masked], clean[masked], reduction="none")
        one = (ce * w).sum() / w.sum()
        for buckets in (1, 2, 3):
            split = bucketed_loss(lm.model, noisy, clean, masked, commit, valid,
                                  weight[:, None].expand_as(masked), buckets)  # fmt: skip
            assert abs(float(split) - float(one)) < 1e-4, buckets


def test_value_share_asks_value_questions_alone() -> None:
    """``value_share``: that share of the decision rows is a value question asked alone (one slot,
    its choices the clause's values)."""
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    rows = _batch(3, TrainConfig(batch=8, decision_share=1.0, value_share=1.0), lm.tokenizer, 4)
    assert all(len(r.units) == 1 for r in rows)
    texts = [lm.tokenizer.decode(list(r.ids)) for r in rows]
    assert all(any(a in t for a in VALUE_ASKS) for t in texts), texts


def test_focus_share_asks_the_focus_kind_about_a_contract_stating_it() -> None:
    """``focus_kind``/``focus_share`` 1: every decision row asks the focus kind alone, about a
    contract of the focus stream that states its clause: its value question or one of its group's
    two questions, both drawn; ``focus_steps``: every row before that step is one (then the
    recipe's); ``focus_joint`` 1: every focus row asks the group's two questions jointly, one
    slot each; a kind without a share or steps, those without a kind, an unknown kind, no steps,
    a share of no decision rows, or a joint share without a kind or outside (0, 1] is refused."""
    from worker.training.contracts import HEADINGS
    from worker.training.corpus import GROUP_CLAUSES, focus_case, focus_value_case

    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    config = TrainConfig(batch=16, decision_share=1.0, focus_kind="law", focus_share=1.0)
    rows = _batch(3, config, lm.tokenizer, 4)
    def law_asked(rows: list[Row]) -> list[bool]:
        """Per row: a value question (True) or a law group question (False); any other fails."""
        texts = [lm.tokenizer.decode(list(r.ids)) for r in rows]
        value = ["Which law governs the agreement?" in t for t in texts]
        group = ["Is the agreement governed by the laws of" in t for t in texts]
        assert all(v != g for v, g in zip(value, group, strict=True)), texts
        assert all(len(r.units) == 1 for r in rows)
        return value

    asks = law_asked(rows)
    assert any(asks) and not all(asks)  # both value and group questions
    for i in range(20):
        case, value = focus_case("train", 0, i, "law"), focus_value_case("train", 0, i, "law")
        assert case.groups[0].kind == value.groups[0].kind == "law" and case.context == value.context
        assert value.groups[0].rule == "value" and value.answers[0] in case.context
        headed = focus_case("train", 0, i, "law", headings=True)
        assert f"{HEADINGS[GROUP_CLAUSES['law']]}." in headed.context
    warm = TrainConfig(batch=16, decision_share=0.0, focus_kind="law", focus_steps=4)
    law_asked(_batch(3, warm, lm.tokenizer, 4))  # law only, no generation row yet
    assert all(not r.units for r in _batch(4, warm, lm.tokenizer, 4))  # then the recipe's rows
    joint = TrainConfig(batch=8, decision_share=1.0, focus_kind="law", focus_share=1.0, focus_joint=1.0)
    for row in _batch(3, joint, lm.tokenizer, 4):
        text = lm.tokenizer.decode(list(row.ids))
        assert text.count("Is the agreement governed by the laws of") == 2 and len(row.units) == 2, text
        assert "Which law governs the agreement?" not in text
    half = TrainConfig(batch=16, decision_share=0.0, focus_kind="law", focus_steps=4, focus_joint=0.5)
    slots = [len(r.units) for r in _batch(2, half, lm.tokenizer, 4)]  # in the start too
    assert set(slots) == {1, 2}, slots  # joint rows and rows of one question
    for bad in ({"focus_kind": "law"}, {"focus_share": 0.2}, {"focus_steps": 5},
                {"focus_kind": "law", "focus_share": 0.0}, {"focus_kind": "nope", "focus_share": 0.2},
                {"focus_kind": "law", "focus_steps": 0},
                {"focus_kind": "law", "focus_share": 0.2, "decision_share": 0.0},
                {"focus_joint": 0.5}, {"focus_kind": "law", "focus_share": 0.2, "focus_joint": 0.0},
                {"focus_kind": "law", "focus_share": 0.2, "focus_joint": 1.5}):  # fmt: skip
        with pytest.raises(TrainConfigError):
            train_demo(Path("/nonexistent/never-written"), TrainConfig(**bad))


def test_extract_share_turns_decision_rows_into_extraction_rows() -> None:
    """``extract_share``: that share of the decision rows (after value questions) is an extract
    job's prompt and canvas, a choice slot per field."""
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    rows = _batch(3, TrainConfig(batch=8, decision_share=1.0, extract_share=1.0), lm.tokenizer, 4)
    for row in rows:
        text = lm.tokenizer.decode(list(row.ids))
        fields = text.count(": one of ")  # the prompt's field list: "- name: one of ..."
        assert "Answer with JSON holding:" in text and 2 <= len(row.units) == fields <= 3


def test_joint_share_asks_that_share_of_the_question_rows_jointly() -> None:
    """``joint_share`` 1: every question row is a joint row (all its group's slots); 0: every one
    asks one question alone."""
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    joint = _batch(3, TrainConfig(batch=8, decision_share=1.0, joint_share=1.0), lm.tokenizer, 4)
    alone = _batch(3, TrainConfig(batch=8, decision_share=1.0, joint_share=0.0), lm.tokenizer, 4)
    assert all(len(r.units) >= 2 for r in joint) and all(len(r.units) == 1 for r in alone)


def test_unset_options_keep_the_first_recipe_s_batches_draw_for_draw() -> None:
    """The rows of the first recipe and of the second round's options, steps 0-2, hashed: the
    digest was computed at f8a914a, before ``vocab`` and ``value_share`` existed (with the random
    demo's tokenizer, which no option changes). A new option that draws when unset changes it;
    ``value_share=0``, ``extract_share=0`` and ``tool_share=0`` must not draw either."""
    import hashlib

    from worker.model.demo_tokenizer import build_demo_tokenizer
    from worker.training.tokenizer import wrap

    tokenizer = wrap(build_demo_tokenizer(512))
    for zero in (False, True):
        digest = hashlib.sha256()
        share = 0.0 if zero else None
        configs = (
            TrainConfig(batch=8, value_share=share, extract_share=share, tool_share=share),
            TrainConfig(batch=8, decision_share=0.9, served_slots=True, groups=3, value_share=share,
                        extract_share=share, tool_share=share),
        )
        for config in configs:
            for step in range(3):
                for row in _batch(step, config, tokenizer, 4):
                    digest.update(repr((row.ids, row.predicted, row.units)).encode())
        assert digest.hexdigest() == "5c43c2946cffd9489ac294593e62a6e5a296d53e056f77823fb069bd1b77c034", zero


def test_focus_rows_keep_their_draws_without_focus_joint() -> None:
    """The rows of a ``focus_share`` and a ``focus_steps`` config, steps 0-2, hashed: the digest was
    computed at 717ce26, before ``focus_joint`` existed (the thirteenth and fourteenth rounds' focus
    runs must keep their batches while it is unset)."""
    import hashlib

    from worker.model.demo_tokenizer import build_demo_tokenizer
    from worker.training.tokenizer import wrap

    tokenizer = wrap(build_demo_tokenizer(512))
    digest = hashlib.sha256()
    configs = (TrainConfig(batch=8, decision_share=0.75, value_share=0.5, focus_kind="law", focus_share=0.5),
               TrainConfig(batch=8, focus_kind="law", focus_steps=2))  # fmt: skip
    for config in configs:
        for step in range(3):
            for row in _batch(step, config, tokenizer, 4):
                digest.update(repr((row.ids, row.predicted, row.units)).encode())
    assert digest.hexdigest() == "79e613d240fe1646a82ce8602330fd9816ef0c398a5ad137ee566a8c5fdaa740"


def test_a_shaped_demo_scales_the_widths_and_keeps_the_layer_pattern(tmp_path: Path) -> None:
    from worker.model.demo_tokenizer import build_demo_tokenizer
    from worker.training.shape import write_shaped_demo

    write_shaped_demo(tmp_path / "d", seed=0, arch="clover", tokenizer=build_demo_tokenizer(512), hidden=64,
                      layers=6)  # fmt: skip
    lm = load_checkpoint(tmp_path / "d", dtype=torch.float32)
    assert lm.config.num_hidden_layers == 6 and lm.config.hidden_size == 64
    assert lm.config.layer_types == ("linear_attention", "full_attention") * 3
    write_shaped_demo(tmp_path / "b", seed=0, arch="clover", tokenizer=build_demo_tokenizer(512), hidden=64,
                      layers=4, block_size=8)  # fmt: skip
    wide = load_checkpoint(tmp_path / "b", dtype=torch.float32)
    assert wide.config.block_size == 8 and lm.config.block_size == 4  # only the block changed
    assert wide.config.layer_types == lm.config.layer_types[:4] and wide.config.hidden_size == 64


def test_a_short_run_repeats_bit_for_bit_and_resumes_to_the_same_bytes(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    config = TrainConfig(steps=4, batch=2, save_every=2)
    straight = tmp_path / "straight"
    train_demo(straight, config)

    class Interrupt(Exception):
        pass

    def stop_at_3(step: int, loss: float) -> None:
        if step == 3:
            raise Interrupt

    resumed = tmp_path / "resumed"
    with pytest.raises(Interrupt):
        train_demo(resumed, config, progress=stop_at_3)
    assert (resumed / RESUME_FILE).is_file()  # the resume point of step 2
    result = train_demo(resumed, config)
    assert result.finished and result.steps == 4 and not (resumed / RESUME_FILE).exists()
    for name in (SINGLE_NAME, "tokenizer.json", "config.json", "training.json", "manifest.json"):
        assert (straight / name).read_bytes() == (resumed / name).read_bytes(), name


def test_a_resume_point_older_than_an_option_resumes_and_another_run_s_is_refused(tmp_path: Path) -> None:
    """A resume point holds the whole configuration; one written before an option existed has no
    entry for it (the option was unset then), so it must still resume. One made with another
    setting must not. A budget spent before the first step leaves a resume point, not a crash."""
    torch.set_num_threads(1)
    config = TrainConfig(steps=2, batch=2, save_every=1)
    folder = tmp_path / "run"
    result = train_demo(folder, config, max_seconds=-1.0)  # stops before its first step
    assert not result.finished and result.steps == 0 and math.isnan(result.first_loss)
    state = torch.load(folder / RESUME_FILE, weights_only=False)
    older = dict(state, config={k: v for k, v in state["config"].items() if k != "joint_share"})
    torch.save(older, folder / RESUME_FILE)
    assert train_demo(folder, config).finished
    train_demo(folder, config, max_seconds=-1.0)  # a fresh run again: the folder had no resume point
    with pytest.raises(TrainConfigError, match="another configuration"):
        train_demo(folder, dataclasses.replace(config, lr=1e-3))


def test_the_shipped_recipe_s_options_repeat_bit_for_bit(tmp_path: Path) -> None:
    """The shipped checkpoint's options (value questions, the larger tokenizer, a GDN layer then
    attention, buckets, served and parallel slots) keep a run deterministic: twice, the same bytes."""
    torch.set_num_threads(1)
    config = TrainConfig(steps=2, batch=3, served_slots=True, decision_share=0.75, decision_weight=3.0,
                         parallel_slots=1.0, buckets=2, layer_pattern="LAAA", vocab=2048,
                         value_share=0.5)  # fmt: skip
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    drawn = [lm.tokenizer.decode(list(r.ids)) for s in (0, 1) for r in _batch(s, config, lm.tokenizer, 4)]
    assert any(a in t for t in drawn for a in VALUE_ASKS)  # the run trains a value question
    for name in ("a", "b"):
        train_demo(tmp_path / name, config)
    for name in (SINGLE_NAME, "tokenizer.json", "config.json", "generation_config.json", "training.json",
                 "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert load_checkpoint(tmp_path / "a").config.vocab_size > 512


def test_a_run_trained_only_in_the_parallel_pass_declares_its_joint_decode(tmp_path: Path) -> None:
    """``--parallel-slots 1.0``: every joint row trained in the parallel pass, so the checkpoint
    says its joint decisions decode in one pass (``CLOVERQ_DECIDE_JOINT_DECODE=auto`` follows
    it); the manifest covers the declaration, and a later stage of another recipe drops it."""
    torch.set_num_threads(1)
    folder = tmp_path / "p1"
    config = TrainConfig(steps=2, batch=3, served_slots=True, decision_share=0.75, parallel_slots=1.0)
    train_demo(folder, config)
    gen = json.loads((folder / "generation_config.json").read_text())
    assert GenerationDefaults.from_dict(gen).joint_decode == "one_pass"
    assert load_checkpoint(folder).generation_config["joint_decode"] == "one_pass"  # verified on load
    declare_joint_decode(folder, None)
    assert "joint_decode" not in json.loads((folder / "generation_config.json").read_text())


def test_the_shipped_trained_demo_loads_with_its_special_tokens() -> None:
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    tok = lm.tokenizer
    assert lm.config.family == "clover" and lm.config.mask_token_id == tok.token_id("<|mask|>")
    assert tok.eos_token_ids[0] == tok.token_id("<|im_end|>") and tok.pad_token_id == tok.token_id("<|pad|>")
    assert tok.think_start_id is not None and tok.think_end_id is not None
    text = tok.render_chat([{"role": "user", "content": "Hi"}], enable_thinking=False)
    im_start = tok.token_id("<|im_start|>")
    assert im_start is not None and tok.encode(text).count(im_start) == 2
    assert (TRAINED_CLOVER_DEMO / SINGLE_NAME).stat().st_size < 4_000_000


def test_a_layer_pattern_sets_the_clover_layer_types() -> None:
    from worker.training.shape import layer_types

    assert layer_types("LA", 4) == ("linear_attention", "full_attention") * 2
    assert layer_types("A", 4) == ("full_attention",) * 4
    assert layer_types("LAA", 6) == ("linear_attention", "full_attention", "full_attention") * 2
    with pytest.raises(ValueError):
        layer_types("LA", 5)


@pytest.mark.parametrize("shape", [{"vocab": 2048}, {"hidden": 96}, {"layers": 8}, {"layer_pattern": "A"}])
def test_a_further_stage_refuses_options_that_reshape_it(tmp_path: Path, shape: dict[str, object]) -> None:
    """``init_from`` continues a trained demo's weights and tokenizer: a shape option would be
    silently ignored, so it is refused before anything is written."""
    config = TrainConfig(steps=1, init_from=str(TRAINED_CLOVER_DEMO), **shape)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="init_from continues"):
        train_demo(tmp_path / "stage", config)
    assert not (tmp_path / "stage").exists()


def test_a_further_stage_may_set_its_block_size(tmp_path: Path) -> None:
    """No weight depends on the block size, so a stage may re-block a trained demo: it trains and
    writes the other block size (config and manifest), the rest of the config as it was; 0 is
    refused."""
    torch.set_num_threads(1)
    with pytest.raises(ValueError, match="block_size"):
        train_demo(tmp_path / "zero", TrainConfig(steps=1, init_from=str(TRAINED_CLOVER_DEMO), block_size=0))
    before = json.loads((TRAINED_CLOVER_DEMO / "config.json").read_text())
    block = 8 if before["block_size"] == 4 else 4
    stage = TrainConfig(steps=1, batch=2, init_from=str(TRAINED_CLOVER_DEMO), block_size=block, save_every=9)
    train_demo(tmp_path / "stage", stage)
    after = json.loads((tmp_path / "stage" / "config.json").read_text())
    assert after == {**before, "block_size": block}
    # the shipped generation config names its block, so the stage's follows (its joint decode is
    # the stage's own recipe's: declare_joint_decode)
    generation = json.loads((TRAINED_CLOVER_DEMO / "generation_config.json").read_text())
    staged = json.loads((tmp_path / "stage" / "generation_config.json").read_text())
    assert "block_size" in generation and staged["block_size"] == block
    assert {**staged, "joint_decode": None} == {**generation, "block_size": block, "joint_decode": None}
    loaded = load_checkpoint(tmp_path / "stage", dtype=torch.float32)  # the manifest verifies
    assert loaded.config.block_size == block


def test_wide_phrasings_draw_the_wide_training_split_and_its_tokenizer_reads_it(tmp_path: Path) -> None:
    """``--wide-phrasings``: the rows come from ``train_wide`` (six wordings of each clause) and a
    fresh run's tokenizer is learned on it, so a word only the extra wordings use is one id."""
    torch.set_num_threads(1)
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    wide = TrainConfig(batch=16, decision_share=1.0, wide_phrasings=True)
    plain_config = TrainConfig(batch=16, decision_share=1.0)

    def drawn(config: TrainConfig) -> list[str]:
        rows = [r for step in range(4) for r in _batch(step, config, lm.tokenizer, 4)]
        return [lm.tokenizer.decode(list(r.ids)) for r in rows]

    texts, plain = drawn(wide), drawn(plain_config)
    assert any(o in t for t in texts for o in EXTRA_OPENINGS)
    assert not any(o in t for t in plain for o in EXTRA_OPENINGS)
    train_demo(tmp_path / "w", TrainConfig(steps=1, batch=2, vocab=2048, wide_phrasings=True))
    assert len(load_checkpoint(tmp_path / "w").tokenizer.encode(" aggregate")) == 1
    assert len(lm.tokenizer.encode(" aggregate")) > 1  # the shipped tokenizer never read it
