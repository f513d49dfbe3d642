"""A Gated DeltaNet layer of Clover's trunk: causal commits and the block-diffusion preview.

One forward handles both kinds of rows of a pass (see ``LinearStep``): each row's leading
``commit_len`` tokens are committed by the trunk's causal path (short causal conv over the ring,
the gated delta rule from the committed state ``S``; ring and ``S`` advance), then its block rows
are previewed against the state just committed (``preview``: the conv with right taps and the
block mixer with a history slot; nothing lasting written). The formulas are docs/models.md's;
the points decided where the public record is silent come from ``clover_decided``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.model import clover_decided as decided
from worker.model.config import ModelConfig
from worker.model.delta_rule import delta_rule
from worker.model.hybrid_cache import HybridCache
from worker.model.norm import GatedRMSNorm


@dataclass(frozen=True)
class LinearStep:
    """Which rows of one forward commit and which preview, shared by every GDN layer.

    Row ``b`` feeds ``commit_lens[b]`` tokens to commit, then ``preview_rows[b]`` block rows at
    token indices ``preview_index[b, :preview_rows[b]]`` (further entries are padding and point at
    the dummy index ``T``). Without a cache every valid token is a commit row from a zero state and
    nothing is stored (the plain causal forward).
    """

    cache: HybridCache | None
    read_rows: torch.Tensor | None  # [B] cache rows of the committed copies
    write_rows: torch.Tensor | None  # [B] cache rows a commit writes
    commit_lens: torch.Tensor  # [B] long
    commit_mask: torch.Tensor  # [B, Tc] bool: token t < commit_lens[b]
    preview_index: torch.Tensor  # [B, P] long token index of each preview row (T = padding)
    preview_rows: torch.Tensor  # [B] long preview rows per row
    preview_valid: torch.Tensor  # [B, P] bool

    @property
    def commit_tokens(self) -> int:
        return self.commit_mask.shape[1]

    @property
    def preview_width(self) -> int:
        return self.preview_index.shape[1]


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, state_index: int) -> None:
        super().__init__()
        self.state_index = state_index  # this layer's position among the GDN layers (cache lists)
        h = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.dk = config.linear_key_head_dim
        self.dv = config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        self.channels = config.linear_conv_dim
        self.key_dim = self.num_k_heads * self.dk
        self.in_proj_qkv = nn.Linear(h, self.channels, bias=False)
        self.in_proj_z = nn.Linear(h, self.num_v_heads * self.dv, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(self.channels, self.kernel))  # [C, K] causal taps
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.num_v_heads * self.dv, h, bias=False)
        # block-diffusion preview tensors
        self.conv_right_weight = nn.Parameter(torch.zeros(self.channels, self.kernel - 1))  # [C, K-1]
        self.bd_logit_scale = nn.Parameter(torch.zeros(self.num_v_heads))  # lambda [Hv]
        self.bd_history_bias = nn.Parameter(torch.zeros(self.num_v_heads))  # [Hv]
        self.bd_history_c = nn.Parameter(torch.zeros(self.num_v_heads))  # [Hv]

    def forward(self, x: torch.Tensor, step: LinearStep) -> torch.Tensor:  # [B, T, hidden] -> same
        b, t, _ = x.shape
        mixed = self.in_proj_qkv(x)  # [B, T, C] raw (pre-conv) rows
        ring, state = self._committed(step, b, x.device)  # [B, K-1, C], [B, Hv, dk, dv] float32
        out = x.new_zeros(b, t + 1, self.num_v_heads, self.dv)  # [B, T+1, Hv, dv]; T = dummy row
        if step.commit_tokens:
            ring, state = self._commit(x, mixed, ring, state, step, out)
        if step.preview_width:
            self._preview(mixed, ring, state, step, out)
        z = self.in_proj_z(x).view(b, t, self.num_v_heads, self.dv)
        return self.out_proj(self.norm(out[:, :t], z).reshape(b, t, -1))

    # ---- committed state ---------------------------------------------------------------------
    def _committed(self, step: LinearStep, b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if step.cache is None or step.read_rows is None:
            ring = torch.zeros(b, self.kernel - 1, self.channels, device=device)
            state = torch.zeros(b, self.num_v_heads, self.dk, self.dv, device=device)
            return ring, state
        return step.cache.ring[self.state_index][step.read_rows], step.cache.state[self.state_index][
            step.read_rows
        ]

    # ---- causal commit -------------------------------------------------------------------------
    def _commit(
        self,
        x: torch.Tensor,
        mixed: torch.Tensor,
        ring: torch.Tensor,
        state: torch.Tensor,
        step: LinearStep,
        out: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tc = step.commit_tokens
        keep = step.commit_mask  # [B, Tc]
        rows = torch.cat((ring.to(mixed.dtype), mixed[:, :tc]), dim=1)  # [B, K-1+Tc, C]
        y = F.silu(self._conv(rows, self.conv_weight))  # [B, Tc, C]
        q, k, v = self._heads(y)  # [B, Hv, Tc, dk] x2 (unit), [B, Hv, Tc, dv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x[:, :tc]).float() + self.dt_bias.float())
        beta = torch.sigmoid(self.in_proj_b(x[:, :tc]).float())  # [B, Tc, Hv]
        g = (g * keep[..., None]).transpose(1, 2)  # [B, Hv, Tc]: g = beta = 0 leaves S as it is
        beta = (beta * keep[..., None]).transpose(1, 2)
        o, new_state = delta_rule(q * self.dk**-0.5, k, v, g, beta, state)  # [B, Hv, Tc, dv]
        out[:, :tc] = (o.transpose(1, 2) * keep[..., None, None]).to(out.dtype)
        # the ring after the commit: the last K-1 rows of ring ++ committed rows
        taps = torch.arange(self.kernel - 1, device=rows.device)
        pick = (step.commit_lens[:, None] + taps[None, :])[..., None].expand(-1, -1, self.channels)
        new_ring = rows.gather(1, pick).float()  # [B, K-1, C]
        if step.cache is not None and step.write_rows is not None:
            step.cache.ring[self.state_index][step.write_rows] = new_ring
            step.cache.state[self.state_index][step.write_rows] = new_state
        return new_ring, new_state

    # ---- block-diffusion preview ---------------------------------------------------------------
    def _preview(
        self,
        mixed: torch.Tensor,
        ring: torch.Tensor,
        state: torch.Tensor,
        step: LinearStep,
        out: torch.Tensor,
    ) -> None:
        _b, p = step.preview_index.shape
        index = step.preview_index.clamp(max=mixed.shape[1] - 1)
        block = mixed.gather(1, index[..., None].expand(-1, -1, self.channels))  # [B, P, C] raw rows
        left = self._conv(torch.cat((ring.to(block.dtype), block), dim=1), self.conv_weight)  # [B, P, C]
        ahead = decided.right_tap_rows(block, step.preview_rows, self.kernel - 1)  # [B, P+K-1, C]
        right = self._conv(ahead[:, 1:], self.conv_right_weight)  # sum_d Wr[:, d-1] X[t+d]: [B, P, C]
        q, k, v = self._heads(F.silu(left + right))  # [B, Hv, P, dk] x2 (unit), [B, Hv, P, dv]
        logits = decided.block_logits(q, k, self.bd_logit_scale)  # [B, Hv, P, P]
        logits = logits.masked_fill(~step.preview_valid[:, None, None, :], float("-inf"))
        history = decided.history_logit(self.bd_history_bias, self.bd_history_c, step.preview_rows)  # [B, Hv]
        history = history[:, :, None, None].expand(-1, -1, p, 1)  # [B, Hv, P, 1]
        weights = torch.softmax(torch.cat((logits, history), dim=-1), dim=-1)  # [B, Hv, P, P+1] float32
        u = decided.history_value(q, state)  # [B, Hv, P, dv]
        o = weights[..., :p] @ v.float() + weights[..., p:] * u  # [B, Hv, P, dv]
        target = step.preview_index[:, :, None, None].expand(-1, -1, self.num_v_heads, self.dv)
        out.scatter_(1, target, o.transpose(1, 2).to(out.dtype))  # padding rows land on the dummy

    # ---- shared pieces -------------------------------------------------------------------------
    def _conv(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Depthwise conv without padding: ``out[t] = sum_j weight[:, j] * rows[t + j]``.

        ``rows`` ``[B, L, C]``, ``weight`` ``[C, W]`` -> ``[B, L - W + 1, C]``.
        """
        kernel = weight.to(rows.dtype)[:, None, :]  # [C, 1, W]
        return F.conv1d(rows.transpose(1, 2), kernel, groups=self.channels).transpose(1, 2)

    def _heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split conv outputs ``[B, T, C]`` into unit q, unit k (repeated to the v heads) and v."""
        b, t, _ = y.shape
        q, k, v = y.split((self.key_dim, self.key_dim, self.num_v_heads * self.dv), dim=-1)
        repeat = self.num_v_heads // self.num_k_heads  # v-head h reads k-head h // repeat [V]
        q = decided.l2norm(q.float().view(b, t, self.num_k_heads, self.dk)).repeat_interleave(repeat, dim=2)
        k = decided.l2norm(k.float().view(b, t, self.num_k_heads, self.dk)).repeat_interleave(repeat, dim=2)
        v = v.float().view(b, t, self.num_v_heads, self.dv)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, Hv, T, d]
