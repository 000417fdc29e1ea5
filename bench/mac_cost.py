"""What authenticating a group of rounds costs a head's sender thread and a tail, with and without a busy thread
beside it (the head's step loop holds the interpreter lock most of the time it is not waiting on the device).

    python -m bench.mac_cost [--hidden 3584] [--rows 9] [--dtype bfloat16] [--batch 1,16,64,256] [--reps 200]

Defaults are the Qwen2.5-7B split at K=8 (9 rows of 3,584 in bfloat16: 63 KiB a session). For each B and each
number of busy threads (0, 1; the interpreter's switch interval set to a worker's, `engine.switch_interval_ms`),
milliseconds to:
- seal B rounds one HMAC each over its header and rows (`seal`, as every round was before relay protocol 4, and
  as a round that goes alone still is), then pack them into one entry (`pack_group`), as protocol 3 did;
- seal them as one group entry (`seal_group`: one SHA-256 over the group's tensors, then B small HMACs);
- check them on a tail: each alone (`authentic`), or the group (`unpack_group`, then `authentic` on each part).
hashlib lets go of the interpreter lock while it hashes a buffer of 2 KiB or more and must take it back after:
with a busy thread beside, each take waits for it to let go (up to a switch interval). A round a HMAC is a take a
session; a group's one digest is one take.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

from schemas.groups import pack_group, seal_group, unpack_group
from schemas.keys import Keys
from schemas.macs import authentic, seal, session_key
from schemas.packets import HeadRef, make_round
from schemas.requests import SamplingParams
from schemas.settings import EngineSettings

HEAD = HeadRef(name="bench", boot="0123456789abcdef", reply_timeout_s=15.0)


def round_fields(rows: int, hidden: int, dtype: torch.dtype, key: bytes, start: int) -> dict:
    header = dict(
        session_id=f"bench-{start}",
        head=HEAD,
        reply_to=Keys.head_reply_to(HEAD.name, HEAD.boot),
        round_id=7,
        start_pos=start,
        input_ids=[11],
        draft_ids=list(range(100, 100 + rows - 1)),
        sampling=SamplingParams(),
        eos_token_ids=[2],
        max_new=64,
        q_kind="none",
    )
    return make_round(header, {"hidden": torch.randn(rows, hidden).to(dtype)}, key)[1]


def time_ms(fn: Callable[[], object], reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


class Busy:
    """`n` threads running Python beside the measurement, as a step loop does."""

    def __init__(self, n: int) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._spin, daemon=True) for _ in range(n)]

    def _spin(self) -> None:
        x = 0
        while not self.stop.is_set():
            for _ in range(1000):
                x += 1

    def __enter__(self) -> Busy:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--rows", type=int, default=9)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    dtype, interval = getattr(torch, a.dtype), EngineSettings().switch_interval_ms
    if interval is not None:
        sys.setswitchinterval(interval / 1000)
    kib = a.rows * a.hidden * dtype.itemsize / 1024
    print(f"hidden {a.hidden}, {a.rows} rows, {a.dtype}: {kib:.1f} KiB a round; switch interval {interval} ms")
    print("| B | busy threads | seal each, pack ms | seal the group ms | check each round ms | check the group ms |")
    print("|---|---|---|---|---|---|")
    for b in (int(x) for x in a.batch.split(",")):
        keys = [session_key() for _ in range(b)]
        rounds = [(k, round_fields(a.rows, a.hidden, dtype, k, 10 + i)) for i, k in enumerate(keys)]
        alone = [(k, seal(k, f)) for k, f in rounds]
        group = seal_group(rounds)
        reps = max(a.reps // b, 5)
        for busy in (0, 1):
            with Busy(busy):
                each = time_ms(lambda rounds=rounds: pack_group([seal(k, f) for k, f in rounds]), reps)
                grouped = time_ms(lambda rounds=rounds: seal_group(rounds), reps)
                check_each = time_ms(lambda a=alone: [authentic(k, f) for k, f in a], reps)
                check_group = time_ms(lambda g=group, ks=keys: _checked(g, ks), reps)
            print(f"| {b} | {busy} | {each:.3f} | {grouped:.3f} | {check_each:.3f} | {check_group:.3f} |")


def _checked(group: dict, keys: list[bytes]) -> list[bool]:
    parts = unpack_group(group, max_bytes=1 << 31)
    return [authentic(k, p) for k, p in zip(keys, parts, strict=True)]


if __name__ == "__main__":
    main()
