"""A drafter's one-token steps as Triton kernels (workers/engine/decode_kernels.py), run on this CPU through Triton's
interpreter (Triton is a test dependency; tests/conftest.py sets TRITON_INTERPRET=1 without CUDA): a whole greedy draft
with them proposes what the fused forward in place proposes and leaves the same keys and values in the pool (Qwen2:
q/k/v bias; Qwen3: per-head q/k norms), and the shard takes them only where every layer qualifies. On the GPU
bench/draft_kernels.py (removed: git history before 92894f6) compared them with the fused forward, and the job path's
outputs with the reference
(docs/runs/journal.md runs 86-90)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from workers.engine import decode_kernels
from workers.engine.graphs import greedy_steps
from workers.engine.kvcache import BatchView, KVPool
from workers.engine.shard import load_shard
from workers.tiny_models import build_tokenizer, save_tiny_model

TOL = dict(rtol=1e-4, atol=1e-4)
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton was imported uninterpreted")


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    root, tok = tmp_path_factory.mktemp("decode"), build_tokenizer()
    # two layers (one a shard when a target is split): Triton's interpreter pays for every program of every layer
    out = {f: save_tiny_model(root / f, f, tokenizer=tok, layers=2) for f in ("qwen2", "qwen3")}
    # widths no power of two (every kernel's masks), three query heads a key/value head
    odd = dict(hidden=96, intermediate_size=200, num_attention_heads=6, num_key_value_heads=2, head_dim=16, layers=2)
    out["odd"] = save_tiny_model(root / "odd", "qwen3", tokenizer=tok, **odd)
    return out


@pytest.fixture
def two_splits(monkeypatch):
    """Rows of a few tokens read their keys in 2 splits, not 8: the merge is exercised the same, and Triton's
    interpreter runs a quarter of the attention programs (they took most of these tests' minutes on 2 cores)."""
    from workers.engine import decode_triton

    monkeypatch.setattr(decode_triton, "SPLITS", 2)


def _pair(path):
    a, b = load_shard(path, None, embed=True, head=True), load_shard(path, None, embed=True, head=True)
    for s in (a, b):
        s.set_attention("in_place")
    assert a.set_decode_kernels(True) and not b.set_decode_kernels(False)
    return a, b


@pytest.mark.parametrize(
    ("family", "n"),
    [("qwen3", 3), pytest.param("qwen2", 6, marks=pytest.mark.slow), pytest.param("odd", 2, marks=pytest.mark.slow)],
)  # a plain `pytest` runs Qwen3's (its per-head norm too); qwen2's rounds run through the kernels in the next test
@torch.inference_mode()
def test_a_draft_through_the_kernels_equals_the_fused_draft(drafters, family, n, monkeypatch, two_splits):
    """Two rows: every step through the GEMV kernels, the first step's 2 tokens a row as 4 rows of one token (causal
    within the step); three, one of them padding: the first step's 6 rows through the GEMMs between the kernels, the
    next through the GEMVs; six: every step through the GEMMs."""
    a, b = _pair(drafters[family])
    ran = []
    call = decode_kernels.DecodeLayers.__call__
    monkeypatch.setattr(decode_kernels.DecodeLayers, "__call__", lambda *args: ran.append(1) or call(*args))
    torch.manual_seed(3)
    pools = [KVPool.for_shard(s, slots=6, max_len=64, scratch=12) for s in (a, b)]
    lens = {0: 5, 2: 19} if n < 6 else {0: 5, 1: 9, 2: 19, 3: 3, 4: 12, 5: 7}
    for s, length in lens.items():  # prompts through the fused forward, their keys and values copied to the kernels'
        prompt = torch.randint(0, a.config.vocab_size, (1, length))
        pos = torch.arange(length)[None]
        b.run_batch(prompt, pos, BatchView(pools[1], torch.tensor([s]), pos))
    for kv in ("keys", "values"):  # (through the interpreted kernels they took half these tests' time)
        for i, t in getattr(pools[1], kv).items():
            getattr(pools[0], kv)[i].copy_(t)
    real = list(lens)[: min(n, 6)]
    rows = torch.tensor(real + [pools[0].pad_slot] * (n - len(real)))
    pos = torch.tensor([[lens[s], lens[s] + 1] for s in real] + [pools[0].index[-2:].tolist()] * (n - len(real)))
    x = torch.randint(0, a.config.vocab_size, (n, 2))
    pick = torch.tensor([[i % 2] for i in range(n)])  # rows feeding one token or two
    got = greedy_steps(a.run_batch, pools[0], rows, x, pos, pick, 4, None, in_place=True)
    want = greedy_steps(b.run_batch, pools[1], rows, x, pos, pick, 4, None, in_place=True)
    assert torch.equal(got[: len(real)], want[: len(real)]) and len(ran) >= 3  # every one-token step: the kernels
    for i in pools[0].keys:
        for j, slot in enumerate(real):  # prompt, feed, drafts written
            m = lens[slot] + 1 + int(pick[j]) + 3
            for got_kv, want_kv in ((pools[0].keys[i], pools[1].keys[i]), (pools[0].values[i], pools[1].values[i])):
                torch.testing.assert_close(got_kv[slot, :, :m], want_kv[slot, :, :m], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", pytest.param("odd", marks=pytest.mark.slow)])  # odd widths: CI's run
@torch.inference_mode()
def test_a_targets_rounds_through_the_kernels_equal_the_fused_forward(drafters, family, monkeypatch, two_splits):
    """A target split in two (the head's layers from the embeddings, the tail's to the LM head; engine.
    target_kernel_rows): two rounds of 9 tokens a row of a batch, a padding row among them, through the GEMMs between
    the kernels (a round's tokens attend in one program a key/value head and sequence) give the fused forward's
    hidden states and logits, and leave the same keys and values in the pool."""
    path, cut = drafters[family], 1
    n_layers = load_shard(path, (0, 1), embed=True, head=False).config.num_hidden_layers
    ran = []
    call = decode_kernels.DecodeLayers.__call__
    monkeypatch.setattr(decode_kernels.DecodeLayers, "__call__", lambda *args: ran.append(args[1].shape) or call(*args))
    torch.manual_seed(5)
    lens = {0: 5, 2: 19, 3: 11}
    prompts = {s: torch.randint(0, 200, (1, n)) for s, n in lens.items()}
    rounds = [torch.randint(0, 200, (4, 9)) for _ in range(2)]
    head_out: dict[tuple[str, int], torch.Tensor] = {}
    for layers, embed, head in (((0, cut), True, False), ((cut, n_layers), False, True)):
        a, b = (load_shard(path, layers, embed=embed, head=head) for _ in range(2))
        for s in (a, b):
            s.set_attention("in_place")
        assert a.set_decode_kernels(True, rows=4096) and not b.set_decode_kernels(False)
        pools = [KVPool.for_shard(s, slots=4, max_len=64, scratch=12) for s in (a, b)]
        outs: list[list[torch.Tensor]] = [[], []]
        for shard, pool, out in zip((a, b), pools, outs, strict=True):
            for s, n in lens.items():
                pos = torch.arange(n)[None]
                x = prompts[s] if embed else head_out[("p", s)]
                got = shard.run_batch(x, pos, BatchView(pool, torch.tensor([s]), pos))
                out.append(got if not head else got[:, :0])
            rows = torch.tensor([*lens, pool.pad_slot])
            for r, ids in enumerate(rounds):
                pos = torch.tensor([[lens[s] + 9 * r + i for i in range(9)] for s in lens] + [pool.index[-9:].tolist()])
                x = ids if embed else head_out[("r", r)]
                pick = torch.arange(9).expand(4, 9) if head else None
                out.append(shard.run_batch(x, pos, BatchView(pool, rows, pos), pick)[:3])
        for got, want in zip(*outs, strict=True):
            torch.testing.assert_close(got, want, **TOL)
        if embed:  # the tail's inputs: the head's outputs
            head_out.update({("p", s): outs[1][i] for i, s in enumerate(lens)})
            pad = torch.zeros_like(outs[1][3][:1])  # the padding row's
            head_out.update({("r", r): torch.cat([outs[1][3 + r], pad]) for r in range(2)})
        for i in pools[0].keys:
            for slot, n in lens.items():
                for got_kv, want_kv in ((pools[0].keys[i], pools[1].keys[i]), (pools[0].values[i], pools[1].values[i])):
                    torch.testing.assert_close(got_kv[slot, :, : n + 18], want_kv[slot, :, : n + 18], **TOL)
    assert sum(1 for shape in ran if shape[:2] == (4, 9)) == 4  # both rounds of both shards through the kernels


@torch.inference_mode()
def test_steps_the_kernels_do_not_take_run_the_fused_forward(drafters, monkeypatch):
    """More rows than draft_kernel_rows, or a reach past MAX_REACH: the fused forward runs (the kernels are never
    called)."""
    a, _ = _pair(drafters["qwen2"])
    assert a.set_decode_kernels(True, rows=decode_kernels.MAX_ROWS)
    calls = []
    monkeypatch.setattr(decode_kernels.DecodeLayers, "__call__", lambda *args: calls.append(1))
    pool = KVPool.for_shard(a, slots=6, max_len=32, scratch=4)
    rows = torch.arange(5)
    pos = torch.full((5, 1), 3)
    a.run_batch(torch.ones(5, 1, dtype=torch.long), pos, BatchView(pool, rows, pos))
    monkeypatch.setattr(decode_kernels, "MAX_REACH", 8)
    a.run_batch(torch.ones(2, 1, dtype=torch.long), pos[:2], BatchView(pool, rows[:2], pos[:2]))
    assert not calls
    monkeypatch.setattr(decode_kernels, "MAX_REACH", 1024)
    a.run_batch(torch.ones(2, 1, dtype=torch.long), pos[:2], BatchView(pool, rows[:2], pos[:2]))
    assert calls


def test_a_layer_the_kernels_cannot_run_keeps_them_off(drafters):
    """A layer with its q/k/v apart (a CPU load keeps them so), or no attention in place: not taken."""
    a = load_shard(drafters["qwen2"], None, embed=True, head=True)
    assert not a.set_decode_kernels(True)  # attention gathers on this CPU unless set in place
    a.set_attention("in_place")
    a.fused.layers[0].act = "gelu_pytorch_tanh"
    assert not a.set_decode_kernels(True)


def test_a_machine_whose_triton_cannot_build_them_keeps_the_fused_forward(drafters, monkeypatch, caplog):
    """At load a step through the kernels is checked against the fused forward on the shard's own layers: a build or
    launch failure (a missing C compiler, say) or a disagreement keeps them off, with a warning."""
    from workers.engine import decode_triton

    half = load_shard(drafters["qwen2"], None, embed=True, head=True, dtype=torch.bfloat16)
    half.set_attention("in_place")
    assert half.set_decode_kernels(True)  # bfloat16's roundings differ from the fused forward's: still agreed
    a = load_shard(drafters["qwen2"], None, embed=True, head=True)
    a.set_attention("in_place")
    assert a.set_decode_kernels(True) and a.fused.decode is not None
    assert not a.set_decode_kernels(False) and a.fused.decode is None

    def broken(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(decode_triton, "rope_write", broken)
    assert not a.set_decode_kernels(True) and a.fused.decode is None
    assert "Failed to find C compiler" in caplog.text
    monkeypatch.undo()
    real = decode_triton.gemv_residual
    monkeypatch.setattr(decode_triton, "gemv_residual", lambda a_, w, r: real(a_, w, r) * 2)
    assert not a.set_decode_kernels(True) and "does not agree" in caplog.text


def _shapes() -> list:
    """(dtype, rows, t, fill): a plain `pytest` runs the fewest rows and the rounds' shape in float32, and the rounds'
    shape in bfloat16; CI every shape in float32. The other shapes in bfloat16 are left to the GPU: on this CPU the
    kernel multiplies float32 operands whatever the dtype (the docstring below), so they tested only the loads'
    casts, which the rounds' shape tests too (and they took 19 s of the suite)."""
    shapes = [(6, 1, None), (40, 1, None), (45, 3, None), (45, 9, 1)]
    quick = [(torch.float32, *shapes[0]), (torch.float32, *shapes[-1]), (torch.bfloat16, *shapes[-1])]
    slow = [(torch.float32, *s) for s in shapes[1:-1]]
    return quick + [pytest.param(*case, marks=pytest.mark.slow) for case in slow]


@pytest.mark.parametrize(("dtype", "rows", "t", "fill"), _shapes())
def test_attention_grouped_by_key_value_head_equals_a_program_a_query_head(dtype, rows, t, fill, monkeypatch):
    """Steps of many rows attend with a program a key/value head and sequence (its keys read once for the query heads
    and tokens sharing them, matrix products): the same as a program a query head and row, at 8 splits, at 2 and at
    one (programs enough to fill the device: no merge), a padding sequence included, rounds of t tokens a sequence
    at consecutive positions (each sees the keys up to its own). bfloat16 too: on the CPU the kernel multiplies
    float32 operands (Triton's interpreter multiplies half-precision ones wrongly). The interpreter also casts float32
    to bfloat16 by truncation, not to nearest as a GPU does: bf16 roundings are checked on the GPU, never here."""
    from workers.engine import decode_triton as k

    if fill is not None:
        monkeypatch.setattr(k, "FILL", fill)
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d = 6, 2, 16
    q = torch.randn(rows, hq * d, generator=gen).to(dtype)
    keys, values = (torch.randn(3, hkv, 300, d, generator=gen).to(dtype) for _ in range(2))
    seqs = rows // t
    slots = (torch.arange(seqs) % 3).repeat_interleave(t)
    last = torch.randint(t, 290, (seqs,), generator=gen)
    pos = (last[:, None] - t + 1 + torch.arange(t)).flatten()
    outs = []
    for grouped in (False, True):
        o = torch.empty_like(q)
        part = k.attend_partials(rows, hq, d, q.device, *((t, hkv) if grouped else (1, 0)))
        assert part.shape[2] == (1 if grouped and fill else 8 if rows <= 32 else 2)
        k.attend(q, keys, values, slots, pos, o, part, 0.25, hq, hkv, d, 2, grouped, t if grouped else 1)
        outs.append(o.float())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("rows", "grouped"), [(2, False), pytest.param(33, True, marks=pytest.mark.slow)])
def test_a_longer_reach_reads_its_keys_in_more_splits_with_the_same_result(rows, grouped, monkeypatch):
    """Rows reaching past REACH_UNIT positions read their keys in as many times more splits (here a unit of 64
    positions, reaching 150: 3 units, 8 x 3 -> 32 splits for a few rows, 2 x 3 -> 8 for many), with the output of
    the base split count (MAX_REACH lets kernels take long contexts: issue 27's B = 16 at 8,192 positions)."""
    from workers.engine import decode_triton as k

    monkeypatch.setattr(k, "REACH_UNIT", 64)
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d = 4, 2, 16
    q = torch.randn(rows, hq * d, generator=gen)
    keys, values = (torch.randn(2, hkv, 150, d, generator=gen) for _ in range(2))
    slots, pos = torch.arange(rows) % 2, torch.randint(100, 150, (rows,), generator=gen)
    outs = []
    for reach, splits in ((0, 8 if rows <= 32 else 2), (150, 32 if rows <= 32 else 8)):
        o = torch.empty_like(q)
        part = k.attend_partials(rows, hq, d, q.device, *((1, hkv) if grouped else (1, 0)), reach)
        assert part.shape[2] == splits
        k.attend(q, keys, values, slots, pos, o, part, 0.25, hq, hkv, d, -1, grouped, 1)
        outs.append(o)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_silu_times_up_as_one_kernel_equals_torch_alone_and_in_a_fused_forward(drafters):
    """What CUDA shards run for SiLU(gate) * up (`FusedLayers._gated`: one Triton kernel over rows [gate, up], rows on
    the grid's first axis; widths no power of two) equals torch's two kernels, alone and in a whole fused forward."""
    from torch.nn import functional as F

    from schemas.settings import Settings
    from workers.engine import decode_triton as k
    from workers.engine.runner import Engine

    gu = torch.randn(37, 400, generator=torch.Generator().manual_seed(0))
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(k.silu_mul(gu), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    assert decode_kernels.silu_mul_kernel(torch.device("cpu"), torch.bfloat16, 200) is None  # CUDA only
    shards = [load_shard(drafters["odd"], None, embed=True, head=True) for _ in range(2)]
    assert shards[0].fused.silu_mul is None
    calls = []
    shards[1].fused.silu_mul = lambda gu: calls.append(gu.shape) or k.silu_mul(gu)
    x = torch.arange(3, 23) % shards[0].config.vocab_size
    engines = [Engine(s, Settings(engine={"static": True, "max_len": 64})) for s in shards]
    got = [e.forward(e.acquire(), x, 0, len(x)) for e in engines]
    torch.testing.assert_close(got[1], got[0], **TOL)
    assert calls == [(len(x), 400)] * 2  # each layer's, through the kernel


@pytest.mark.parametrize(
    ("t", "g", "d", "dtype"),
    [(9, 3, 16, torch.float32), (2, 24, 32, torch.float32), (9, 8, 64, torch.bfloat16), (16, 5, 16, torch.bfloat16)],
)
def test_a_rounds_later_tokens_merge_as_one_kernel_as_torch_merges_them(t, g, d, dtype, monkeypatch):
    """A batch's rounds in place (`pool_attention.attend`, split: every query row attends up to its round's first
    token, then the round's later tokens are merged, causal among themselves) with the merge as one Triton kernel
    (`merge_triton.merge_later`, what CUDA shards run: decode_kernels.merge_kernel): equal to torch's merge, rows in
    any slot, a padding row, the step's keys and values strided as a fused layer's, and more query rows (T x g) than
    one program takes."""
    from workers.engine import merge_triton, pool_attention

    monkeypatch.setattr(pool_attention, "SPLIT_MIN_BATCH", 1)
    gen = torch.Generator().manual_seed(t * g)
    slots, hkv, length = 4, 2, 40
    keys, values = (torch.randn(slots + 1, hkv, length, d, generator=gen).to(dtype) for _ in range(2))
    rows, last = torch.tensor([3, 0, 2, slots]), torch.tensor([t + 4, 30, t - 1, length - 1])
    q = torch.randn(4, t, hkv * g, d, generator=gen).to(dtype)
    lay = pool_attention.layout(rows, last, t, hkv, g, length)
    pos = last[:, None] - t + 1 + torch.arange(t)
    new = tuple(c[rows[:, None], :, pos].transpose(1, 2) for c in (keys, values))  # [B, hkv, T, d], strided
    args = (q, keys, values, lay, 0.25, pool_attention.reference, new)
    want = pool_attention.attend(*args)
    got = pool_attention.attend(*args, merge=merge_triton.merge_later)
    assert lay.mode == "split" and got.dtype == dtype and merge_triton.fits(d, t) and not merge_triton.fits(256, t)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # float32 both; half precision: at most a unit at their rounding
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert decode_kernels.merge_kernel(torch.device("cpu"), dtype, d) is None  # CUDA only
    # the check a CUDA shard makes as it builds the kernel: it agrees; a merge that drops the later tokens does not
    assert decode_kernels._merge_agrees(merge_triton.merge_later, torch.device("cpu"), dtype, d)
    first_only = lambda q, first, *_: first  # noqa: E731
    assert not decode_kernels._merge_agrees(first_only, torch.device("cpu"), dtype, d)
