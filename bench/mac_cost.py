"""What authenticating a round costs: HMAC-SHA256 over a round's header and hidden states (schemas/packets.py
`seal` on the head, `authentic` on the tail), per round and per group of B sessions.

    python -m bench.mac_cost [--hidden 3584] [--rows 9] [--dtype float16] [--batch 1,16,64,256] [--reps 200]

Defaults are the Qwen2.5-7B split at K=8 (9 rows of 3,584 in float16: 63 KiB a session). Prints, for each
B, the milliseconds a head spends encoding B rounds (tensor codec + header + MAC), of which sealing, and a
tail spends checking them (one core; hashlib releases the GIL, so the MACs of a group can run beside the
step loop); then what a tail spends taking the B rounds out of one group entry and decoding their hidden rows,
as it does (tensor bytes as views of the entry's, rows decoded uncopied: "views") and as it did (each part's
bytes copied, each tensor decoded from a copy: "copies").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from schemas.groups import pack_group, unpack_group
from schemas.packets import MAC, HeadRef, authentic, decode_head_header, encode_round, round_tensors, seal, session_key
from schemas.requests import SamplingParams

HEAD = HeadRef(name="bench", boot="0123456789abcdef", reply_timeout_s=15.0)


def round_fields(rows: int, hidden: int, dtype: torch.dtype, key: bytes, start: int) -> tuple[dict, dict]:
    header = dict(
        session_id=f"bench-{start}",
        head=HEAD,
        round_id=7,
        start_pos=start,
        input_ids=[11],
        draft_ids=list(range(100, 100 + rows - 1)),
        sampling=SamplingParams(),
        eos_token_ids=[2],
        max_new=64,
        q_kind="none",
    )
    return header, {"hidden": torch.randn(rows, hidden).to(dtype)}


def time_ms(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--rows", type=int, default=9)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    print(f"hidden {a.hidden}, {a.rows} rows, {a.dtype}: {a.rows * a.hidden * dtype.itemsize / 1024:.1f} KiB a round")
    print(f"{'B':>5} {'encode ms':>10} {'seal ms':>8} {'check ms':>9} {'us/session (seal, check)':>26}")
    for b in (int(x) for x in a.batch.split(",")):
        keys = [session_key() for _ in range(b)]
        rounds = [round_fields(a.rows, a.hidden, dtype, keys[i], 10 + i) for i in range(b)]
        sealed = [encode_round(h, t, k)[1] for (h, t), k in zip(rounds, keys, strict=True)]
        bare = [{n: v for n, v in f.items() if n != MAC} for f in sealed]
        pairs, reps = list(zip(keys, sealed, bare, strict=True)), max(a.reps // b, 5)
        encode = time_ms(
            lambda pairs=pairs, rounds=rounds: [encode_round(*r, p[0]) for r, p in zip(rounds, pairs, strict=True)],
            reps,
        )
        mac = time_ms(lambda pairs=pairs: [seal(k, f) for k, _, f in pairs], reps)
        check = time_ms(lambda pairs=pairs: [authentic(k, f) for k, f, _ in pairs], reps)
        per = f"{1000 * mac / b:.1f}, {1000 * check / b:.1f}"
        print(f"{b:>5} {encode:>10.3f} {mac:>8.3f} {check:>9.3f} {per:>26}")
        if b > 1:
            group = pack_group(sealed)
            views = time_ms(lambda g=group: _unpacked(g, copies=False), reps)
            copies = time_ms(lambda g=group: _unpacked(g, copies=True), reps)
            print(f"{b:>5} group entry unpacked, hidden rows decoded: views {views:.3f} ms, copies {copies:.3f}")


def _unpacked(group: dict, copies: bool) -> list:
    parts = unpack_group(group, max_bytes=1 << 31)
    if copies:  # as the tail did before 2026-12-05
        parts = [{k: bytes(v) for k, v in p.items()} for p in parts]
    views = frozenset() if copies else frozenset({"hidden"})
    return [round_tensors(decode_head_header(p), p, views=views)["hidden"] for p in parts]


if __name__ == "__main__":
    main()
