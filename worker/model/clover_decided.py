"""Every point of Clover's preview contract that the public record leaves open, decided here.

Clover-35B-A3B-Preview's official modeling file is not public where cloverq is built, so the
points it would settle are decided once, in this module, and every implementation (the model,
the tests' written-out reference, the docs) reads them from here. Changing one is one edit.
The tags follow docs/models.md: [C] described in public prose, [D] decided here.

Open points, to settle when ``modeling_clover_moe.py`` can be read: the history value ``u`` and
whether the gates ``g``/``beta`` enter it; the parametrisation of the logit scale; the right taps
at the block's end; the order of ``conv_right_weight``'s taps; coreset routing in previews; the
RoPE positions of preview rows; the mask id, threshold and ``</think>`` defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ---- decoding defaults [C]/[D] ----------------------------------------------------------------
DEFAULT_BLOCK_SIZE = 32  # [C] used when neither the config nor the request names one
DEFAULT_STRATEGY = "dynamic"  # [C] "LowConfidence" remasking
DEFAULT_THRESHOLD = 0.95  # [D]
DEFAULT_TEMPERATURE = 0.0  # [D] greedy
# steps per block default to the block size [D] (see ``decoding_defaults``)
MASK_TOKEN_CANDIDATES: tuple[str, ...] = ("<|mask|>", "<|MASK|>", "[MASK]")  # [D] after config's id


@dataclass(frozen=True)
class DecodingDefaults:
    """What a request that names nothing decodes with."""

    block_size: int
    steps_per_block: int | None  # None: as many steps as the request's block has positions
    strategy: str
    threshold: float

    def steps_for(self, block_size: int) -> int:
        return self.steps_per_block or block_size


def decoding_defaults(block_size: int | None) -> DecodingDefaults:
    """Clover's defaults for a checkpoint whose config gives ``block_size`` (or none)."""
    return DecodingDefaults(block_size or DEFAULT_BLOCK_SIZE, None, DEFAULT_STRATEGY, DEFAULT_THRESHOLD)


# ---- the preview operator of a Gated DeltaNet layer -------------------------------------------
L2NORM_EPS = 1e-6  # [V] as transformers' l2norm: x * rsqrt(sum(x^2) + eps)
HISTORY_REFERENCE_ROWS = 32  # [C] the history logit's slope is in ln(rows / 32)
# [D] the commit/prefill attention is the trunk's token-causal one, not block-causal
# [D] before position 0 the conv ring holds zero rows (a short prefix is zero-padded)
# [D] preview rows take RoPE at their absolute positions (as the trunk would)
# [D] a preview's MoE routes with the trunk's ordinary top-k (no "expert coreset")


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """Unit vectors along the last dim, as the trunk normalises GDN queries and keys."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def history_logit(bias: torch.Tensor, slope: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Logit of the history slot: ``bias + slope * ln(rows / 32)`` [C].

    ``bias``/``slope`` are ``[Hv]``; ``rows`` ``[B]`` is the number of preview rows of each row's
    block (its block size, also for the prompt's partial first block [D]). Returns ``[B, Hv]``.
    """
    scale = torch.log(rows.to(torch.float32) / HISTORY_REFERENCE_ROWS)  # [B]
    return bias.float()[None, :] + slope.float()[None, :] * scale[:, None]


def block_logits(q_hat: torch.Tensor, k_hat: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``L[t, s] = lambda_h <q̂_t, k̂_s>`` over every block row s, s = t included [C]/[D].

    Unit vectors in (``[B, Hv, P, dk]``), the per-head ``scale`` ``[Hv]`` used raw (no 1/sqrt(d),
    no exp or softplus) [D]. Returns ``[B, Hv, P, P]`` float32.
    """
    return scale.float()[None, :, None, None] * (q_hat.float() @ k_hat.float().transpose(-1, -2))


def history_value(q_hat: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``u_t = Sᵀ (q̂_t · dk^-0.5)`` read from the committed state, no decay, no beta [D].

    ``q_hat`` ``[B, Hv, P, dk]``, ``state`` ``[B, Hv, dk, dv]`` (float32). Returns
    ``[B, Hv, P, dv]`` float32. The gates ``a``/``b`` take no part in a preview [D].
    """
    dk = q_hat.shape[-1]
    return (q_hat.float() * dk**-0.5) @ state.float()


def right_tap_rows(x: torch.Tensor, rows: torch.Tensor, taps: int) -> torch.Tensor:
    """The block's raw rows for the right taps, zero past each block's end [D].

    ``x`` ``[B, P, C]`` (preview rows, padded), ``rows`` ``[B]`` valid rows per block. Returns
    ``[B, P + taps, C]``: rows at or past ``rows[b]`` and the ``taps`` rows after the padded block
    are zero, so ``X[t + d]`` reads zero beyond the block's end.
    """
    b, p, _ = x.shape
    inside = torch.arange(p, device=x.device)[None, :] < rows[:, None]  # [B, P]
    x = x * inside[..., None].to(x.dtype)
    return torch.cat((x, x.new_zeros(b, taps, x.shape[-1])), dim=1)
