"""What verifying a tail batch costs: round by round (the tail before issue 26: a finite check per round, then
`judge` per round, each with its own host syncs) against `BatchVerify` (workers/speculative/verify.py: one
reduction, one argmax, one host copy for the batch; sampled rounds one more), on random logits.

    python -m bench.verify_batch [--batch 1,16,64,256] [--vocab 151936] [--k 8] [--mode greedy,mixed,sampled]
                                 [--device cpu|cuda] [--dtype float32] [--reps 3] [--q point|sparse]

Each round has K drafts (K + 1 logits rows of the vocabulary); its drafts are the argmax, or drawn from the warped
target rows, up to a random point, so about `--accept` of them are accepted. `mixed` is half greedy, half sampled
(temperature 0.8; another half of those with top-p 0.9). Prints the median milliseconds of each way per B and
checks they give every round the same (accepted, next token): exit 1 if not.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from schemas.packets import RoundPacket
from schemas.requests import SamplingParams
from workers.engine.numerics import finite_rows
from workers.speculative.sampling import encode_q, warp
from workers.tail.rounds import Prepared, judge, plan_rounds


def make_round(rnd: random.Random, i: int, args: argparse.Namespace, sampled: bool) -> tuple[Prepared, torch.Tensor]:
    """One round: K + 1 rows of random logits on the device and K drafts accepted up to a random point."""
    dev, k = torch.device(args.device), args.k
    g = torch.Generator(device=dev).manual_seed(rnd.randrange(1 << 30))
    logits = (torch.randn(k + 1, args.vocab, generator=g, device=dev) * 4).to(getattr(torch, args.dtype))
    keep = next((j for j in range(k) if rnd.random() > args.accept), k)  # drafts the target would pick
    s = SamplingParams()
    if sampled:
        s = SamplingParams(temperature=0.8, top_p=0.9 if i % 4 == 3 else 1.0, seed=rnd.randrange(1 << 20))
        drafts = torch.multinomial(warp(logits[:k], s), 1)[:, 0].tolist()
    else:
        drafts = logits[:k].argmax(-1).tolist()
    drafts = drafts[:keep] + [(d + 1) % args.vocab for d in drafts[keep:]]
    kind, tensors = ("point" if sampled and k else "none"), {}
    if kind == "point" and args.q == "sparse":  # a drafter's q: half its mass on its draft, the rest on 64 tokens
        q = torch.zeros(k, args.vocab, device=dev)
        q[:, :64] = 0.5 / 64
        q[torch.arange(k, device=dev), torch.tensor(drafts, device=dev)] += 0.5
        kind, tensors = encode_q(q)
    packet = RoundPacket.model_construct(
        session_id=f"bench-{i}",
        round_id=rnd.randrange(1000),
        input_ids=[1],
        draft_ids=drafts,
        sampling=s,
        q_kind=kind,
        replay=False,
    )
    return Prepared(packet, None, b"", torch.zeros(0), tensors, {}), logits  # type: ignore[arg-type]


def round_by_round(batch: list[Prepared], logits: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The tail's verification before batching: a sync, one finite check per round, `judge` per round."""
    if logits[0].is_cuda:
        torch.cuda.synchronize(logits[0].device)
    finite = finite_rows(logits)
    assert all(finite)
    return [judge(p, lg) for p, lg in zip(batch, logits, strict=True)]


def batched(batch: list[Prepared], logits: list[torch.Tensor], warp_rows: int) -> list[tuple[int, int]]:
    out = plan_rounds(batch, logits[0].device, warp_rows).run(logits)
    assert not any(isinstance(o, Exception) for o in out)
    return out  # type: ignore[return-value]


def median_ms(fn: Callable[[], list[tuple[int, int]]], dev: torch.device, reps: int) -> tuple[float, list]:
    times, got = [], []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        got = fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), got


@torch.inference_mode()
def main() -> int:
    """Time both ways of verifying a batch for each B and mode; exit 1 if they ever disagree."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--accept", type=float, default=0.78, help="chance that each next draft is the target's")
    ap.add_argument("--mode", default="greedy,mixed")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--q", choices=("point", "sparse"), default="point")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warp-rows", type=int, default=128, help="Settings.verify_warp_rows")
    args = ap.parse_args()
    dev = torch.device(args.device)
    print(f"vocab {args.vocab}, K {args.k}, {args.dtype} on {dev}, q {args.q}, median of {args.reps}")
    print(f"{'mode':>8} {'B':>5} {'round by round ms':>18} {'batched ms':>11} {'speedup':>8}")
    same = True
    for mode in args.mode.split(","):
        for b in (int(x) for x in args.batch.split(",")):
            rnd = random.Random(b)
            made = [make_round(rnd, i, args, mode == "sampled" or (mode == "mixed" and i % 2 == 1)) for i in range(b)]
            batch, logits = [p for p, _ in made], [lg for _, lg in made]
            old_ms, old = median_ms(lambda: round_by_round(batch, logits), dev, args.reps)  # noqa: B023
            new_ms, new = median_ms(lambda: batched(batch, logits, args.warp_rows), dev, args.reps)  # noqa: B023
            same = same and old == new
            print(
                f"{mode:>8} {b:>5} {old_ms:>18.2f} {new_ms:>11.2f} {old_ms / new_ms:>7.1f}x"
                + ("" if old == new else "  DIFFER")
            )
    print("every round judged the same both ways" if same else "the two ways DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
