"""What one group's stages must take at the least, and what plain PyTorch takes, for bench/stages.py: the
floor (weights read at the device's bandwidth or FLOPs at its peak, whichever is longer, plus the KV
positions read) and an eager reference of the same GEMMs and SDPA over the real lengths (no CUDA graphs,
no slot gathers, no rotary embeddings). Not run on its own: see `python -m bench.stages --help`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

FLOOR_FORMULA = (
    "floor = sum over weight passes (1 for head and tail, K for the drafter) of max(W / BW, F / P) + KV / BW; "
    "W = bytes of the GEMM weights (q, k, v, o, gate, up, down of each layer, + the LM head where there is one; "
    "no embedding, norms or biases), F = 2 * tokens * W / dtype_bytes + 4 * tokens * attended * heads * head_dim "
    "summed over layers, KV = keys + values of every sequence's attended positions (ctx + the step's tokens) per "
    "layer; where layers differ in width (Gemma 4), each layer's linear weights and widths as loaded (a KV-shared "
    "layer's reads of another's keys left out)"
)


@dataclass(frozen=True)
class Shape:
    """The part of a model one stage runs: `layers` decoder layers, with or without its LM head."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    layers: int
    lm_head: bool
    dtype_bytes: int
    per_layer: tuple[tuple[int, int, int], ...] = ()  # (GEMM params, q width, kv width) where layers differ

    @classmethod
    def of(cls, config: object, layers: int, lm_head: bool, dtype: torch.dtype) -> Shape:
        c = config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # type: ignore[attr-defined]
        return cls(
            c.hidden_size,  # type: ignore[attr-defined]
            c.num_attention_heads,  # type: ignore[attr-defined]
            c.num_key_value_heads,  # type: ignore[attr-defined]
            head_dim,
            c.intermediate_size,  # type: ignore[attr-defined]
            c.vocab_size,  # type: ignore[attr-defined]
            layers,
            lm_head,
            torch.empty((), dtype=dtype).element_size(),
        )

    @classmethod
    def of_layers(cls, config: object, layers: nn.ModuleList, lm_head: bool, dtype: torch.dtype) -> Shape:
        """A stage whose layers differ in width (Gemma 4: wider full-attention heads, double-wide MLPs, KV-shared
        layers without key/value projections), measured on the loaded layers: each one's linear weights, query
        width and keys + values a position (0 for a layer that reads another's: those reads are left out)."""
        per = []
        for layer in layers:
            attn = layer.self_attn
            params = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
            k, v = getattr(attn, "k_proj", None), getattr(attn, "v_proj", None)
            kv = (k.out_features + (v if v is not None else k).out_features) if k is not None else 0
            per.append((params, attn.q_proj.out_features, kv))
        c, size = config, torch.empty((), dtype=dtype).element_size()  # no one width: 0s (the reference is refused)
        return cls(c.hidden_size, 0, 0, 0, 0, c.vocab_size, len(layers), lm_head, size, tuple(per))  # type: ignore[attr-defined]

    @property
    def widths(self) -> tuple[tuple[int, int, int], ...]:
        """Each layer's (GEMM params, q width, keys + values a position)."""
        if self.per_layer:
            return self.per_layer
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return ((h * q + 2 * h * kv + q * h + 3 * h * self.inter, q, 2 * kv),) * self.layers

    @property
    def gemm_params(self) -> int:
        return sum(p for p, _, _ in self.widths) + (self.vocab * self.hidden if self.lm_head else 0)

    @property
    def weight_bytes(self) -> int:
        return self.gemm_params * self.dtype_bytes

    def flops(self, tokens: int, attended: int) -> float:
        attention = 4 * tokens * attended * sum(q for _, q, _ in self.widths)
        return 2.0 * tokens * self.gemm_params + attention

    def kv_bytes(self, seqs: int, attended: int) -> float:
        return float(seqs * sum(kv for _, _, kv in self.widths) * attended * self.dtype_bytes)

    def pass_floor_ms(self, seqs: int, tokens_each: int, attended: int, bw: float, peak: float) -> float:
        """One weight pass over `seqs` sequences of `tokens_each` tokens attending `attended` positions each;
        bw in bytes/s, peak in FLOP/s."""
        t = max(self.weight_bytes / bw, self.flops(seqs * tokens_each, attended) / peak)
        return (t + self.kv_bytes(seqs, attended) / bw) * 1000


def uniform(config: object) -> bool:
    """Whether the config gives one width for every layer (transformers' heterogeneous configs, Gemma 4's, refuse
    a global `head_dim`)."""
    try:
        getattr(config, "head_dim", None)
    except Exception:
        return False
    return True


def floors_ms(
    draft: Shape, head: Shape, tail: Shape, b: int, k: int, ctx: int, bw: float, peak: float
) -> dict[str, float]:
    """The floor of each stage for one group of b sequences with ctx positions cached and K drafts."""
    return {
        "draft": sum(draft.pass_floor_ms(b, 1, ctx + 1 + i, bw, peak) for i in range(k)),
        "head": head.pass_floor_ms(b, k + 1, ctx + k + 1, bw, peak),
        "tail": tail.pass_floor_ms(b, k + 1, ctx + k + 1, bw, peak),
    }


class Reference:
    """Random weights of a Shape (all its layers, separately: no layer's weights stay in the L2 for the next),
    run eagerly: per layer RMSNorm, one q/k/v GEMM, SDPA over the cache's first positions, the output GEMM,
    RMSNorm, one gate/up GEMM, SiLU * up, the down GEMM; then the norm and LM head where it has one."""

    def __init__(
        self, s: Shape, device: torch.device, dtype: torch.dtype, embed: bool, share: Reference | None = None
    ) -> None:
        """`share`: a Reference of as many layers of the same model whose layer weights this one reuses (the
        head's and the tail's run one after the other, so no weights stay cached between them)."""
        self.s, self.device, self.dtype = s, device, dtype
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim

        def w(*shape: int) -> torch.Tensor:
            return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 0.02)

        if share is not None and len(share.layers) == s.layers and share.s.hidden == s.hidden:
            self.layers = share.layers
        else:
            self.layers = [
                (
                    w(s.hidden, qkv),
                    w(qkv),
                    w(s.heads * s.head_dim, s.hidden),
                    w(s.hidden, 2 * s.inter),
                    w(s.inter, s.hidden),
                )
                for _ in range(s.layers)
            ]
        self.norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.embed = w(s.vocab, s.hidden) if embed else None
        self.lm = w(s.hidden, s.vocab) if s.lm_head else None

    def cache(self, b: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values [b, kv_heads, length, head_dim] per layer (random: only their reads count)."""
        s = self.s
        shape = (b, s.kv_heads, length, s.head_dim)
        return [
            (
                torch.randn(shape, device=self.device, dtype=self.dtype),
                torch.randn(shape, device=self.device, dtype=self.dtype),
            )
            for _ in range(s.layers)
        ]

    def layers_forward(self, x: torch.Tensor, kv: list, start: int) -> torch.Tensor:
        """x [b, t, hidden] at positions start..start+t-1 of every sequence; writes its keys/values into kv."""
        s, (b, t, _) = self.s, x.shape
        nq, nk = s.heads * s.head_dim, s.kv_heads * s.head_dim
        mask = None
        if t > 1:  # causal within the step, everything before it
            mask = (
                torch.arange(start + t, device=x.device)[None, :]
                <= torch.arange(start, start + t, device=x.device)[:, None]
            )
        for (wqkv, bqkv, wo, wgu, wd), (kc, vc) in zip(self.layers, kv, strict=True):
            h = F.rms_norm(x, (s.hidden,), self.norm)
            q, k, v = torch.addmm(bqkv, h.view(b * t, -1), wqkv).split([nq, nk, nk], dim=-1)
            kc[:, :, start : start + t] = k.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
            vc[:, :, start : start + t] = v.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
            q = q.view(b, t, s.heads, s.head_dim).transpose(1, 2)
            a = F.scaled_dot_product_attention(
                q, kc[:, :, : start + t], vc[:, :, : start + t], attn_mask=mask, enable_gqa=True
            )
            x = x + (a.transpose(1, 2).reshape(b, t, nq) @ wo)
            g, u = (F.rms_norm(x, (s.hidden,), self.norm) @ wgu).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ wd
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        lm = self.lm if self.lm is not None else self.embed.T  # type: ignore[union-attr]
        return F.rms_norm(x, (self.s.hidden,), self.norm) @ lm

    def head(self, ids: torch.Tensor, kv: list, start: int) -> torch.Tensor:
        """The lower shard over ids [b, t]: hidden states."""
        assert self.embed is not None
        return self.layers_forward(F.embedding(ids, self.embed), kv, start)

    def tail(self, x: torch.Tensor, kv: list, start: int) -> list:
        """The upper shard + LM head over x [b, t, hidden]: every row's argmax, read once."""
        return self.logits(self.layers_forward(x, kv, start)).argmax(-1).tolist()

    def draft(self, ids: torch.Tensor, kv: list, start: int, k: int) -> list:
        """k greedy steps from ids [b, 1] at position start, fed back on the device; read once."""
        assert self.embed is not None
        out, cur = [], ids
        for i in range(k):
            h = self.layers_forward(F.embedding(cur, self.embed), kv, start + i)
            cur = self.logits(h[:, -1:]).argmax(-1)
            out.append(cur)
        return torch.cat(out, dim=1).tolist()
