"""The gated delta rule of Gated DeltaNet layers: the causal commit/prefill mixer of Clover's trunk.

Per value head and token ``t`` (state ``S`` ``[dk, dv]``, float32)::

    S <- exp(g_t) * S
    S <- S + k_t (x) beta_t * (v_t - Sᵀ k_t)
    o_t = Sᵀ q_t

Two exact forms of the same recurrence: ``recurrent_delta_rule`` walks the tokens, and
``chunked_delta_rule`` processes chunks of tokens with matrix products (the WY form: inside a
chunk the sequential updates become one unit-triangular solve). Prefill and the commit of a block
use the chunked form with chunks of at most 32 tokens: measured on CPU (fp32, 1 thread, 8-32
heads of 64-128 dims, batch 1-16) it beat the token loop at every length from 1 token up (e.g.
16 rows x 8 heads x 32 tokens: 14 ms vs 77 ms; 1 token: 1.4 vs 3.1 ms), and 32-token chunks beat
64-token ones (no padding of a 32-token block; 512 tokens: 217 vs 237 ms). The token loop stays as
the plain statement of the recurrence that the tests check the chunked form against. A token
with ``g = 0`` and ``beta = 0`` leaves the state unchanged, which is how padding and rows that
commit nothing ride along in a batch.

On CUDA the flash-linear-attention kernel (``fla.ops.gated_delta_rule``) is used when it imports
and agrees with the torch form on a probe (checked once per device and dtype); the torch code
here stays the single statement of the math and the CPU path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CHUNK = 32  # most tokens per chunk of the WY form (fewer when the sequence is shorter)


def delta_rule(
    q: torch.Tensor,  # [B, H, T, dk] float32, unit-norm and already scaled by dk^-0.5
    k: torch.Tensor,  # [B, H, T, dk] float32, unit-norm
    v: torch.Tensor,  # [B, H, T, dv] float32
    g: torch.Tensor,  # [B, H, T] float32 log decay (<= 0)
    beta: torch.Tensor,  # [B, H, T] float32 in [0, 1]
    state: torch.Tensor,  # [B, H, dk, dv] float32 committed state before the first token
) -> tuple[torch.Tensor, torch.Tensor]:  # o [B, H, T, dv], final state [B, H, dk, dv]
    """The recurrence over ``T`` tokens from ``state``, by the fastest exact form available."""
    kernel = _fla_kernel(q.device, q.dtype) if q.is_cuda else None
    if kernel is not None:
        return kernel(q, k, v, g, beta, state)
    return chunked_delta_rule(q, k, v, g, beta, state, chunk=max(1, min(CHUNK, q.shape[2])))


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token (shapes as ``delta_rule``)."""
    s = state.clone()
    out = []
    for t in range(q.shape[2]):
        s = s * g[:, :, t, None, None].exp()  # [B, H, dk, dv]
        predicted = (k[:, :, t, :, None] * s).sum(dim=-2)  # Sᵀk [B, H, dv]
        correction = (v[:, :, t] - predicted) * beta[:, :, t, None]  # [B, H, dv]
        s = s + k[:, :, t, :, None] * correction[:, :, None, :]
        out.append((q[:, :, t, :, None] * s).sum(dim=-2))  # Sᵀq [B, H, dv]
    o = torch.stack(out, dim=2) if out else v.new_zeros(v.shape)
    return o, s


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks of ``chunk`` tokens (shapes as ``delta_rule``).

    Inside a chunk with inclusive log-decay prefix ``c_i = g_1 + ... + g_i`` and entering state
    ``S0``, the token updates unroll to: ``W = (I + A)^-1`` with ``A[i, j] = beta_i k_i·k_j
    e^(c_i - c_j)`` for ``j < i``; pseudo-values ``U = W (beta v) - W (beta k e^c) S0``; outputs
    ``o = (q e^c) S0 + ((q kᵀ) * e^(c_i - c_j), j <= i) U``; and the leaving state
    ``S = e^(c_C) S0 + (k e^(c_C - c))ᵀ U``.
    """
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    chunk = 1 << (chunk - 1).bit_length()  # a power of two, for the blocked triangular inverse
    pad = -t % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))  # [B, H, N, C, d]
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)  # [B, H, N, C]

    c = g.cumsum(dim=-1)  # [B, H, N, C] inclusive log-decay prefix
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()  # j <= i
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B,H,N,C,C]
    k_beta = k * beta[..., None]  # [B, H, N, C, dk]
    a = (k_beta @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]; the diagonal is ignored below
    rhs = torch.cat((v * beta[..., None], k_beta * c.exp()[..., None]), dim=-1)  # [B, H, N, C, dv+dk]
    solved = unit_lower_inverse(a) @ rhs  # (I + strictly-lower(a))^-1 rhs
    u_fixed, k_decayed = solved.split((dv, dk), dim=-1)  # [B,H,N,C,dv], [B,H,N,C,dk]
    scores = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]
    q_decayed = q * c.exp()[..., None]  # [B, H, N, C, dk]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]  # [B, H, N, C, dk]
    chunk_decay = c[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    s = state
    out = []
    for i in range(n):
        u = u_fixed[:, :, i] - k_decayed[:, :, i] @ s  # [B, H, C, dv]
        out.append(q_decayed[:, :, i] @ s + scores[:, :, i] @ u)  # [B, H, C, dv]
        s = s * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = torch.cat(out, dim=2)[:, :, :t]  # [B, H, T, dv]
    return o, s


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """``(I + L)^-1`` for ``L`` the strictly lower triangle of ``a`` ``[..., C, C]`` (C a power of 2).

    Blocked inversion, doubling the block size each round: for a unit lower-triangular matrix
    ``[[T11, 0], [T21, T22]]`` the inverse is ``[[T11^-1, 0], [-T22^-1 T21 T11^-1, T22^-1]]``, and
    every pair of diagonal blocks of one round is combined in one batched product. Same result as
    a unit-triangular solve (forward substitution), but 2 log2(C) batched matmuls instead of one
    small LAPACK call per chunk and head, which dominated prefill on CPU (0.67 s of a 16 x 512
    prefill's ~5 s were ``linalg.solve_triangular`` on 32 x 32 systems).
    """
    c = a.shape[-1]
    lead = a.shape[:-2]
    blocks = torch.ones(*lead, c, 1, 1, dtype=a.dtype, device=a.device)  # inverses of 1 x 1 blocks
    size = 1
    while size < c:
        n = c // (2 * size)
        pairs = blocks.reshape(*lead, n, 2, size, size)
        inv11, inv22 = pairs[..., 0, :, :], pairs[..., 1, :, :]  # [..., n, s, s]
        grid = a.reshape(*lead, n, 2 * size, n, 2 * size)
        diagonal = torch.diagonal(grid, dim1=-4, dim2=-2).movedim(-1, -3)  # [..., n, 2s, 2s]
        lower = diagonal[..., size:, :size]  # T21 of each pair
        merged = torch.zeros(*lead, n, 2 * size, 2 * size, dtype=a.dtype, device=a.device)
        merged[..., :size, :size] = inv11
        merged[..., size:, size:] = inv22
        merged[..., size:, :size] = -(inv22 @ lower @ inv11)
        blocks, size = merged, 2 * size
    return blocks.reshape(*lead, c, c)


# ---- flash-linear-attention on CUDA (probed once) -----------------------------------------------
_FLA: dict[tuple[str, int | None, torch.dtype], Any] = {}


def _fla_kernel(device: torch.device, dtype: torch.dtype) -> Any:
    """fla's chunked kernel adapted to our layout, or None where it is missing or disagrees."""
    key = (device.type, device.index, dtype)
    if key not in _FLA:
        _FLA[key] = _probe_fla(device)
    return _FLA[key]


def _probe_fla(device: torch.device) -> Any:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # deferred: optional extra cloverq[cuda]
    except Exception:  # not installed / no triton: the torch form serves
        return None

    def kernel(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        s: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # fla takes [B, T, H, d]; q is already scaled, so scale=1
        o, final = chunk_gated_delta_rule(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            g.transpose(1, 2),
            beta.transpose(1, 2),
            scale=1.0,
            initial_state=s,
            output_final_state=True,
        )
        return o.transpose(1, 2).float(), final.float()

    gen = torch.Generator().manual_seed(0)
    b, h, t, d = 1, 2, 40, 16
    q = F.normalize(torch.randn(b, h, t, d, generator=gen), dim=-1).to(device) * d**-0.5
    k = F.normalize(torch.randn(b, h, t, d, generator=gen), dim=-1).to(device)
    v = torch.randn(b, h, t, d, generator=gen).to(device)
    g = -torch.rand(b, h, t, generator=gen).to(device)
    beta = torch.rand(b, h, t, generator=gen).to(device)
    s0 = torch.randn(b, h, d, d, generator=gen).to(device) * 0.1
    try:
        got_o, got_s = kernel(q, k, v, g, beta, s0)
    except Exception as exc:
        log.info("flash-linear-attention unusable on %s (%s): torch gated delta rule", device, exc)
        return None
    ref_o, ref_s = chunked_delta_rule(q, k, v, g, beta, s0)
    if torch.allclose(got_o, ref_o, atol=2e-2, rtol=2e-2) and torch.allclose(
        got_s, ref_s, atol=2e-2, rtol=2e-2
    ):
        log.info("flash-linear-attention gated delta rule in use on %s", device)
        return kernel
    log.warning("flash-linear-attention disagrees with the torch gated delta rule on %s: not used", device)
    return None
