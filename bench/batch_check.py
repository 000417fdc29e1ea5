"""Check batched forwards (KV pools, padding, graph buckets, one-slot spare pools) against one sequence
at a time with growing caches, on any device: the diagnostic for `Engine.forward_many`.

    python -m bench.batch_check --device cuda:0          # graphs + eager static vs dynamic reference
    python -m bench.batch_check --device cpu              # eager static only

Builds a tiny random Qwen2-shaped model in float32, runs N sequences for several rounds of random
lengths with rollbacks, and prints the largest difference per (mode, role, N) from the same weights
run one sequence at a time through the HF layers. Exit 1 above 1e-4.
"""

from __future__ import annotations

import random
import sys

import click
import torch

from bench.synthetic import load_shard
from schemas.settings import Settings
from workers.engine.kvcache import KVCache
from workers.engine.runner import Engine


def rollback(rnd: random.Random, caches: list, refs: list[KVCache], starts: list[int]) -> None:
    """Roll each sequence back to a random committed prefix past its step's start, as verification does."""
    for cache, ref, start in zip(caches, refs, starts, strict=True):
        keep = rnd.randint(start + 1, cache.length)
        cache.crop(keep)
        ref.crop(keep)


@torch.inference_mode()
def check(engine: Engine, ref_shard, n: int, rounds: int, logits: int, seed: int) -> float:
    rnd = random.Random(seed)
    dev, vocab, width = engine.shard.device, engine.shard.config.vocab_size, engine.shard.config.hidden_size
    step = engine.step_tokens

    def inputs(m: int) -> torch.Tensor:
        if engine.shard.embed is not None:
            return torch.tensor([rnd.randrange(vocab) for _ in range(m)], device=dev)
        return torch.randn(m, width, generator=torch.Generator().manual_seed(rnd.randrange(1 << 30))).to(dev)

    caches = [engine.acquire() for _ in range(n)]
    refs = [KVCache() for _ in range(n)]
    worst = 0.0
    for r in range(rounds):
        xs = [inputs(rnd.randint(12, 20) if r == 0 else rnd.randint(1, step)) for _ in range(n)]
        starts = [c.length for c in caches]
        wants = [min(logits, x.shape[0]) if logits else 0 for x in xs]
        got = engine.forward_many(caches, xs, starts, wants)
        for i in range(n):
            want = ref_shard(xs[i], starts[i], refs[i], wants[i])
            worst = max(worst, float((got[i].float() - want.float()).abs().max()))
        rollback(rnd, caches, refs, starts)
    for c in caches:
        engine.release(c)
    return worst


@torch.inference_mode()
def check_drafts(engine: Engine, ref_shard, n: int, rounds: int, seed: int) -> int:
    """Whole greedy drafts (`Engine.draft_many`: one graph per draft) against token-by-token drafting with
    growing caches; returns the number of rows that differ (drafts or cache lengths)."""
    rnd = random.Random(seed)
    dev, vocab = engine.shard.device, engine.shard.config.vocab_size

    def tokens(m: int) -> torch.Tensor:
        return torch.tensor([rnd.randrange(vocab) for _ in range(m)], device=dev)

    caches = [engine.acquire() for _ in range(n)]
    refs = [KVCache() for _ in range(n)]
    for c, r in zip(caches, refs, strict=True):
        x = tokens(rnd.randint(12, 20))
        engine.forward(c, x, 0)
        ref_shard(x, 0, r)
    bad = 0
    for _ in range(rounds):
        feeds = [tokens(rnd.randint(1, 2)) for _ in range(n)]
        ks = [rnd.randint(1, engine.max_draft) for _ in range(n)]
        starts = [c.length for c in caches]
        got = engine.draft_many(caches, [f.tolist() for f in feeds], starts, ks)
        assert got is not None, "draft_many did not apply"
        rows = got.tolist()
        for i in range(n):
            cur = int(ref_shard(feeds[i], starts[i], refs[i], 1)[-1].argmax())
            want = [cur]
            for j in range(1, ks[i]):
                pos = starts[i] + feeds[i].shape[0] + j - 1
                cur = int(ref_shard(torch.tensor([cur], device=dev), pos, refs[i], 1)[-1].argmax())
                want.append(cur)
            bad += rows[i][: ks[i]] != want or caches[i].length != refs[i].length
        rollback(rnd, caches, refs, starts)
    for c in caches:
        engine.release(c)
    return bad


@torch.inference_mode()
def compare_fused(device: str) -> float:
    """The lean fused forward (workers/engine/fused.py) against the Hugging Face layers, same weights."""
    a = load_shard("random:tiny", None, embed=True, head=True, device=device, dtype=torch.float32, fused=True)
    b = load_shard("random:tiny", None, embed=True, head=True, device=device, dtype=torch.float32, fused=False)
    assert a.fused is not None and b.fused is None
    torch.manual_seed(1)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        pa.data.normal_(0, 0.2)
        pb.data.copy_(pa.data)
    x = torch.randint(0, a.config.vocab_size, (40,), device=device)
    ca, cb = KVCache(), KVCache()
    worst = float((a(x[:30], 0, ca, 30) - b(x[:30], 0, cb, 30)).abs().max())
    for i in range(30, 40):
        worst = max(worst, float((a(x[i : i + 1], i, ca, 1) - b(x[i : i + 1], i, cb, 1)).abs().max()))
    return worst


@click.command()
@click.option("--device", default="cuda:0")
@click.option("--rounds", type=int, default=6)
def main(device: str, rounds: int) -> None:
    from transformers import Qwen2Config  # noqa: F401  (random preset builds one)

    head = load_shard("random:tiny", (0, 2), embed=True, head=False, device=device, dtype=torch.float32)
    tail = load_shard("random:tiny", (2, 4), embed=False, head=True, device=device, dtype=torch.float32)
    full = load_shard("random:tiny", None, embed=True, head=True, device=device, dtype=torch.float32)
    torch.manual_seed(0)
    refs = {}  # the one-at-a-time references run the HF layers (same weights): fused and batched both checked
    for shard in (head, tail, full):  # not identity-dominated: differences show
        for p in shard.parameters():
            p.data.normal_(0, 0.2)
        ref = load_shard(
            "random:tiny",
            shard.layer_range,
            embed=shard.embed is not None,
            head=shard.lm_head is not None,
            device=device,
            dtype=torch.float32,
            fused=False,
        )
        for pr, ps in zip(ref.parameters(), shard.parameters(), strict=True):
            pr.data.copy_(ps.data)
        refs[id(shard)] = ref
    modes = [("eager-static", dict(static=True, graphs=False))]
    if device.startswith("cuda"):
        modes.append(("graphs", dict(graphs=True)))
    bad = False
    for mode, opts in modes:
        for role, shard, step, pad, logits in (
            ("head", head, 9, True, 0),
            ("tail", tail, 9, True, 9),
            ("drafter", full, 2, False, 1),
        ):
            engine = Engine(shard, Settings(engine={"max_len": 256, **opts}), step_tokens=step, pad=pad, slots=8)
            for n in (1, 2, 5, 8, 11):  # 11 > 8 slots: three sequences in one-slot spare pools
                worst = check(engine, refs[id(shard)], n, rounds, logits, seed=n)
                flag = "OK" if worst < 1e-4 else "BAD"
                bad |= flag == "BAD"
                click.echo(f"{mode:12s} {role:8s} n={n:2d} max|diff|={worst:.2e} {flag}")
        settings = Settings(engine={"max_len": 256, **opts})
        engine = Engine(full, settings, step_tokens=2, pad=False, slots=8, max_draft=8)
        for n in (1, 3, 8):
            bad_rows = check_drafts(engine, refs[id(full)], n, rounds, seed=n)
            bad |= bad_rows > 0
            click.echo(f"{mode:12s} drafts   n={n:2d} rows differing={bad_rows} {'OK' if not bad_rows else 'BAD'}")
        fused_vs_hf = compare_fused(device)
        bad |= fused_vs_hf > 1e-4
        click.echo(
            f"{mode:12s} fused layers vs HF layers max|diff|={fused_vs_hf:.2e} {'OK' if fused_vs_hf < 1e-4 else 'BAD'}"
        )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
