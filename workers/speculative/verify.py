"""Verification of drafted tokens on the tail: greedy matching, or speculative rejection sampling.

Rejection sampling (Leviathan et al.; Chen et al.): accept draft x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from norm(max(0, p_i - q_i)); after K
acceptances sample the bonus token from p_K. The committed tokens are distributed exactly as the
target's own sampling with the same warping.
"""

from __future__ import annotations

import torch

from schemas.errors import PacketError


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """(accepted drafts, next token) for greedy decoding; logits are [k+1, V], drafts host ids: the
    argmax's copy is the round's one device sync."""
    target = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return accepted, target[accepted]


def verify_sampling(
    p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, gen: torch.Generator
) -> tuple[int, int]:
    """(accepted drafts, next token) by rejection sampling; p [k+1, V] target and q [k, V] draft probs."""
    k = drafts.shape[0]
    if k == 0 or q is None:
        if k:
            raise PacketError("sampled drafts arrived without their draft distribution")
        return 0, int(torch.multinomial(p[0], 1, generator=gen))
    uniforms = torch.rand(k, generator=gen, device=gen.device).tolist() if k else []
    rows = torch.arange(k, device=p.device)
    d = drafts.to(p.device)
    px, qx = p[rows, d].tolist(), q.to(p.device)[rows, d].tolist()
    for i in range(k):
        if qx[i] <= 0.0:
            raise PacketError(f"draft token {int(d[i])} has zero probability under its own q")
        if uniforms[i] * qx[i] < px[i]:
            continue
        residual = (p[i] - q[i].to(p.device)).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # only possible through rounding when p == q
            residual = p[i]
        return i, int(torch.multinomial(residual, 1, generator=gen))
    return k, int(torch.multinomial(p[k], 1, generator=gen))
