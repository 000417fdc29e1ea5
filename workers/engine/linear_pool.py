"""Linear-attention layers (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE's Gated DeltaNet) over a static `KVPool`: batches of
sequences in one forward, graph-capturable, with exact rollback of rejected drafts.

A recurrent state cannot be cut back to a shorter prefix as keys and values are. So each slot keeps its states at a
base position (the convolution's last K - 1 inputs and the delta rule's state, float32 as transformers keeps it) and,
in a ring of R columns, the inputs (the layer's projections before its convolution) of the positions since: at most
R. A forward of a row at positions s.. first takes the ring's inputs of base..s-1 (those its cache kept: a rollback
is nothing more than a shorter s), then its own tokens; the delta rule runs over them from the base states, in two
passes with the tokens of the other pass masked out (a token of decay 0 and rate 0 leaves the state as it was):
1. the tokens that fall more than R behind the end of what the row writes: the new base states, written back;
2. the rest, from there: the new tokens' outputs.
Nothing else is written but the new tokens' inputs into the ring, so a rolled-back round leaves the base states bit
for bit as they were. A cache refuses a rollback further back than R from the furthest position it wrote
(`StaticKVCache.crop`); the engines' R (their scratch: a round's tokens and a whole draft) covers their own.

Rows come as a `BatchView` / `StaticKVCache` / `DraftStep` gives them (`linear_view`): slots, positions and, where a
batch is padded past a row's real tokens (prompts), each row's last real position; graphs pad rounds after the
real tokens, which stay in the ring past the row's length, never read. A pool with such layers always has a padding
slot (capture writes states there, never into a live sequence's).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

View = tuple["LinearStates", torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # states, slots [B], pos [B, T], last


def linear_modules(layers: nn.ModuleList) -> dict[int, nn.Module]:
    """Global layer index -> the linear-attention mixer of the layers that have one."""
    return {m.layer_idx: m for layer in layers if (m := getattr(layer, "linear_attn", None)) is not None}


def input_width(m: nn.Module) -> int:
    """What a ring column holds of one token: its convolution's inputs and its rate and decay projections."""
    return m.conv_dim + 2 * m.num_v_heads


def ring_row_bytes(layer: nn.Module, dtype_bytes: int) -> int:
    """Bytes a static pool's ring keeps of one position in a decoder layer (0 for one without linear attention)."""
    m = getattr(layer, "linear_attn", None)
    return input_width(m) * dtype_bytes if m is not None else 0


class LinearStates:
    """The linear layers' states of a pool's `rows` slots (see the module docstring): `base` [rows] positions seen,
    and per layer `conv` [rows, conv_dim, K - 1], `state` [rows, heads, key width, value width] (float32) and the
    ring `inputs` [rows, R + 1, width] (its last column takes what no position keeps)."""

    def __init__(self, modules: dict[int, nn.Module], rows: int, depth: int, dtype: torch.dtype, device: Any) -> None:
        self.depth, self.last = depth, max(modules)
        self.base = torch.zeros(rows, dtype=torch.long, device=device)
        self.conv = {
            i: torch.zeros(rows, m.conv_dim, m.conv_kernel_size - 1, dtype=dtype, device=device)
            for i, m in modules.items()
        }
        self.state = {
            i: torch.zeros(rows, m.num_v_heads, m.head_k_dim, m.head_v_dim, dtype=torch.float32, device=device)
            for i, m in modules.items()
        }
        self.inputs = {
            i: torch.zeros(rows, depth + 1, input_width(m), dtype=dtype, device=device) for i, m in modules.items()
        }

    @staticmethod
    def slot_bytes(modules: dict[int, nn.Module], depth: int, dtype_bytes: int) -> int:
        """Bytes one slot takes over these layers."""
        return sum(
            (m.conv_dim * (m.conv_kernel_size - 1) + (depth + 1) * input_width(m)) * dtype_bytes
            + m.num_v_heads * m.head_k_dim * m.head_v_dim * 4
            for m in modules.values()
        )

    def tensors(self) -> list[torch.Tensor]:
        return [self.base, *self.conv.values(), *self.state.values(), *self.inputs.values()]

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        return [t[slot] for t in self.tensors()]

    def clear(self, slot: int) -> None:
        """Zero one slot in place (a new sequence starts from nothing)."""
        torch._foreach_zero_(self.slot_tensors(slot))


def furthest_base(base: int, written: int, depth: int) -> int:
    """The least position a cache's states may be rolled back to once a step wrote up to `written`."""
    return max(base, written - depth)


def rollback_error(length: int, base: int, depth: int) -> ValueError:
    return ValueError(
        f"cannot roll linear-attention states back to {length} positions: they keep only the last {depth} "
        f"positions written (from {base})"
    )


def pool_backed(layers: nn.ModuleList) -> None:
    """Route each linear layer's forward through `pooled_forward` when its cache is a pool's view (a dynamic
    `RecurrentCache`, or none, keeps transformers' own)."""
    for m in linear_modules(layers).values():
        m.forward = partial(_dispatch, m, m.forward)


def _dispatch(
    module: nn.Module,
    original: Callable[..., torch.Tensor],
    hidden_states: torch.Tensor,
    cache_params: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kw: Any,
) -> torch.Tensor:
    view = getattr(cache_params, "linear_view", None)
    if view is None:
        return original(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kw)
    return pooled_forward(module, hidden_states, *view())


def _project(m: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(convolution inputs [B, T, conv_dim], gate z [B, T, heads, value width], rate b and decay a [B, T, heads]),
    as the family's own forward projects them."""
    b_, t_ = h.shape[:2]
    if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: q, k, v, z and b, a interleaved per key head
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
        return torch.cat([x.reshape(b_, t_, -1) for x in (q, k, v)], -1), z, b, a
    z = m.in_proj_z(h).reshape(b_, t_, -1, m.head_v_dim)
    return m.in_proj_qkv(h), z, m.in_proj_b(h), m.in_proj_a(h)


def pooled_forward(
    m: nn.Module, h: torch.Tensor, states: LinearStates, rows: torch.Tensor, pos: torch.Tensor, last: Any
) -> torch.Tensor:
    """The layer's output [B, T, hidden] for rows of slots `rows` at positions pos [B, T] (see the module
    docstring); no host syncs."""
    i, depth, (b_, t_) = m.layer_idx, states.depth, h.shape[:2]
    mixed, z, b, a = _project(m, h)
    new = torch.cat([mixed, b.to(mixed.dtype), a.to(mixed.dtype)], -1)  # [B, T, width]
    start = pos[:, 0]
    end = last + 1 if last is not None else pos[:, -1] + 1
    real = (end - start).clamp(0, t_)  # the row's real tokens (graph padding counts: it sits past them)
    base = states.base[rows]
    kept = (start - base).clamp(0, depth)  # ring inputs the row keeps before its own tokens
    commit = (kept + real - depth).clamp(min=0)  # tokens that fall behind the ring: the new base
    span = torch.arange(depth + t_, device=h.device)[None]
    ring = states.inputs[i][rows[:, None], (base[:, None] + span[:, :depth]) % depth]  # base.. in order
    src = torch.where(span < kept[:, None], span, (depth + span - kept[:, None]).clamp(max=depth + t_ - 1))
    active = span < (kept + real)[:, None]
    seq = torch.cat([ring, new], 1).gather(1, src[..., None].expand(-1, -1, new.shape[-1]))
    seq = torch.where(active[..., None], seq, 0)  # [B, depth + T, width]: kept then new tokens, zeros after
    x, rate, decay = seq.split([m.conv_dim, m.num_v_heads, m.num_v_heads], -1)
    conv_in = torch.cat([states.conv[i][rows], x.transpose(1, 2)], -1)
    conv = F.conv1d(conv_in.to(m.conv1d.weight.dtype), m.conv1d.weight, m.conv1d.bias, groups=m.conv_dim)
    conv = ACT2FN[m.activation](conv).to(x.dtype).transpose(1, 2)  # [B, depth + T, conv_dim]
    q, k, v = conv.split([m.key_dim, m.key_dim, m.value_dim], -1)
    q, k = (y.reshape(b_, -1, m.num_k_heads, m.head_k_dim) for y in (q, k))
    v = v.reshape(b_, -1, m.num_v_heads, m.head_v_dim)
    if (rep := m.num_v_heads // m.num_k_heads) > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    beta = rate.sigmoid()
    g = -m.A_log.float().exp() * F.softplus(decay.float() + m.dt_bias)
    first = span < commit[:, None]
    rule = sys.modules[type(m).__module__].torch_chunk_gated_delta_rule  # the family's (fla's where installed)

    def run(mask: torch.Tensor, state: torch.Tensor, final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        g_, beta_ = torch.where(mask[..., None], g, 0), torch.where(mask[..., None], beta, 0)
        kw = {"initial_state": state, "output_final_state": final, "use_qk_l2norm_in_kernel": True}
        return rule(q, k, v, g=g_, beta=beta_, **kw)

    early, based = run(first, states.state[i][rows], True)  # the outputs of the tokens it commits too
    late, _ = run(active & ~first, based, False)
    out = torch.where(first[..., None, None], early, late)
    at = (kept[:, None] + span[:, :t_]).clamp(max=depth + t_ - 1)  # new token t's place in the sequence
    core = out.gather(1, at[..., None, None].expand(-1, -1, *out.shape[2:]))
    core = m.norm(core.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(b_, t_, -1)
    _write(states, i, rows, new, start, real, base, commit, conv_in, based)  # type: ignore[arg-type]
    return m.out_proj(core)


def _write(
    states: LinearStates,
    i: int,
    rows: torch.Tensor,
    new: torch.Tensor,
    start: torch.Tensor,
    real: torch.Tensor,
    base: torch.Tensor,
    commit: torch.Tensor,
    cols: torch.Tensor,
    based: torch.Tensor,
) -> None:
    """Write back a forward's base states, its convolution's inputs up to the new base (`cols`: the base's own, then
    those of base..) and its new tokens' inputs (those within R of the end) into the ring."""
    depth, t_ = states.depth, new.shape[1]
    conv = states.conv[i]
    take = commit[:, None] + torch.arange(conv.shape[-1], device=cols.device)[None]
    conv[rows] = cols.gather(2, take[:, None].expand(-1, cols.shape[1], -1))
    states.state[i][rows] = based
    t = torch.arange(t_, device=cols.device)[None]
    at = start[:, None] + t
    keep = (t < real[:, None]) & (at >= (base + commit)[:, None])
    states.inputs[i][rows[:, None], torch.where(keep, at % depth, depth)] = new
    if i == states.last:  # one base for every layer of the slot: moved once, after the last layer read it
        states.base[rows] = base + commit
