"""``train-demo --ema``: the checkpoint written is the exponential moving average of the weights
over the run's steps (a plain-torch reference: the first step's weights, then
``decay * average + (1 - decay) * weights`` each step); training itself is unchanged (the same
losses), and a run interrupted and resumed writes the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

from worker.model.checkpoint import SINGLE_NAME, load_checkpoint
from worker.training.trainer import TrainConfig, TrainConfigError, check_config, train_demo

DECAY = 0.09  # over 3 steps the first step's weights keep 0.8% (EMA_FIRST_SHARE: at most 1%)


def test_the_checkpoint_is_the_moving_average_of_every_step_s_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(1)
    seen: list[dict[str, torch.Tensor]] = []  # the model's weights after each step
    update = AveragedModel.update_parameters

    def spy(self: AveragedModel, model: torch.nn.Module) -> None:
        seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
        update(self, model)

    monkeypatch.setattr(AveragedModel, "update_parameters", spy)
    plain = train_demo(tmp_path / "plain", TrainConfig(steps=3, batch=2, save_every=10))
    averaged = train_demo(tmp_path / "ema", TrainConfig(steps=3, batch=2, save_every=10, ema=DECAY))
    assert len(seen) == 3 and averaged.final_loss == plain.final_loss  # the same training
    reference = dict(seen[0])
    for weights in seen[1:]:
        reference = {n: DECAY * reference[n] + (1 - DECAY) * w for n, w in weights.items()}
    written = dict(load_checkpoint(tmp_path / "ema", dtype=torch.float32).model.named_parameters())
    last = dict(load_checkpoint(tmp_path / "plain", dtype=torch.float32).model.named_parameters())
    for name, value in reference.items():
        torch.testing.assert_close(written[name], value, rtol=1e-6, atol=1e-7)
        assert torch.equal(last[name], seen[-1][name])  # without --ema: the last step's weights
    assert any(not torch.equal(written[n], last[n]) for n in reference)


def test_an_interrupted_ema_run_resumes_to_the_same_bytes(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    config = TrainConfig(steps=4, batch=2, save_every=2, ema=DECAY)
    train_demo(tmp_path / "straight", config)

    class Interrupt(Exception):
        pass

    def stop_at_3(step: int, loss: float) -> None:
        if step == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        train_demo(tmp_path / "resumed", config, progress=stop_at_3)
    assert train_demo(tmp_path / "resumed", config).finished  # from step 2's point, its average with it
    for name in (SINGLE_NAME, "training.json"):
        assert (tmp_path / "straight" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes()


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_a_decay_outside_0_and_1_is_refused(decay: float) -> None:
    with pytest.raises(TrainConfigError, match="ema is a decay"):
        check_config(TrainConfig(ema=decay))


def test_a_decay_that_leaves_the_first_step_more_than_1_percent_is_refused() -> None:
    """The average starts as the first step's weights: 0.998 over 1500 steps leaves them 5%."""
    with pytest.raises(TrainConfigError, match=r"leaves 5\.0% of the checkpoint"):
        check_config(TrainConfig(steps=1500, ema=0.998))
    check_config(TrainConfig(steps=6600, ema=0.998))  # 0.0002%
    check_config(TrainConfig(steps=3, ema=DECAY))
