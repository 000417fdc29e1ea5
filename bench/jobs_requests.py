"""What bench/jobs.py asks for: each job's request (its drafter, its sampling seed) and the worker flags the
benchmark plugin (bench/synthetic.py: the synthetic drafter, `random:<preset>` targets) needs. Not run on its
own: see `python -m bench.jobs --help`.
"""

from __future__ import annotations

import hashlib

from schemas.requests import GenerationRequest


def draft_dict(kind: str, k: int, alpha: float | None = None, ref: list[int] | None = None) -> dict:
    """The request's `draft`: the one place that knows the synthetic drafter's request form."""
    if kind != "synthetic":
        return {"kind": kind, "k": k}
    return {"kind": "synthetic", "k": k, "options": {"alpha": alpha, "reference_ids": ref}}


def plugin_args(synthetic: bool, random_target: bool) -> list[str]:
    """Worker flags the synthetic drafter and random targets need (none otherwise)."""
    return ["--plugin", "bench.synthetic"] if synthetic or random_target else []


def job_seed(prompt_seed: int, index: int) -> int:
    """Job `index`'s sampling seed: the same at every N, distinct per job, below 2**62."""
    return int.from_bytes(hashlib.sha256(f"jobs:{prompt_seed}:{index}".encode()).digest()[:8], "little") >> 2


def seeds_note(same_seed: bool) -> str:
    """What the run's seeds mean for the synthetic drafter (the bench says it in its output)."""
    if same_seed:
        return "seeds: none sent (--same-seed): every job's synthetic drafter rejects the same positions (lockstep)"
    return "seeds: each job its own (sampling.seed): the synthetic drafter's accept/reject pattern differs per job"


def cycle(items: list, n: int) -> list:
    """`items` repeated in order to n entries."""
    return [items[i % len(items)] for i in range(n)]


def request(prompt: list[int], new: int, draft: dict, seed: int | None = None) -> GenerationRequest:
    body: dict = {"prompt_ids": prompt, "max_new_tokens": new, "draft": draft}
    if seed is not None:
        body["sampling"] = {"seed": seed}
    return GenerationRequest.model_validate(body)
