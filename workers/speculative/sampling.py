"""Sampling arithmetic shared by drafters and the tail: warping, seeds, and how q travels.

`warp` applies temperature, then top-k, then top-p, exactly as transformers' warpers do in `generate`,
and returns probabilities. The same function serves target and draft, so the speculative output
distribution is the target's warped distribution.
"""

from __future__ import annotations

import hashlib

import torch

from schemas.errors import PacketError
from schemas.requests import SamplingParams


def warp(logits: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    """Probabilities [n, V] (float32) after temperature, top-k and top-p (HF semantics)."""
    scores = logits.float() / s.temperature
    if 0 < s.top_k < scores.shape[-1]:
        kth = torch.topk(scores, s.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - s.top_p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def round_generator(seed: int, round_id: int, salt: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from (seed, round, salt): reproducible, and independent per round and role."""
    digest = hashlib.sha256(f"{seed}:{round_id}:{salt}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def encode_q(q: torch.Tensor) -> tuple[str, dict[str, torch.Tensor]]:
    """Pick the smaller wire form of draft distributions q [k, V]: sparse support or dense rows."""
    k, vocab = q.shape
    support = int((q > 0).sum(dim=-1).max()) if k else 0
    if support * 8 < vocab * 4:  # int32 index + float32 value per entry vs float32 per token
        val, idx = torch.topk(q, max(support, 1), dim=-1)
        return "sparse", {"q_idx": idx.to(torch.int32), "q_val": val.float()}
    return "dense", {"q": q.float()}


def decode_q(kind: str, drafts: torch.Tensor, tensors: dict[str, torch.Tensor], vocab: int) -> torch.Tensor | None:
    """Dense draft distributions [k, V] from a packet's q encoding (None when greedy)."""
    k = drafts.shape[0]
    if kind == "none":
        return None
    if kind == "point":
        return torch.nn.functional.one_hot(drafts, vocab).float()
    if kind == "dense":
        q = tensors["q"].float()
        if q.shape != (k, vocab):
            raise PacketError(f"dense q is {list(q.shape)}, expected [{k}, {vocab}]")
        return q
    idx, val = tensors["q_idx"].long(), tensors["q_val"].float()
    if idx.shape != val.shape:
        raise PacketError("q_idx and q_val shapes differ")
    if idx.numel() and (idx.min() < 0 or idx.max() >= vocab):
        raise PacketError("q_idx holds a token outside the vocabulary")
    return torch.zeros(k, vocab, device=val.device).scatter_(1, idx.to(val.device), val)
