"""Lossless sampling: the split speculative path samples from the target's own distribution."""

from __future__ import annotations

import itertools
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from workers.head.runtime import HeadRuntime, generate
from workers.speculative.sampling import warp
from workers.speculative.verify import verify_sampling
from workers.tiny_models import save_noisy_copy, save_tiny_model

VOCAB, NEW, DRAWS = 5, 3, 1500
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def sample_draws(runtime, redis_client, names, s: SamplingParams, drafter: str = "model", draws: int = DRAWS):
    """`draws` generations of NEW tokens after PROMPT, each its own seed, 32 in flight at once (the head's step loop
    batches them, as it batches real traffic): (sequences drawn, accepted draft tokens, drafted tokens)."""

    def one(seed: int):
        req = GenerationRequest(
            prompt_ids=PROMPT,
            max_new_tokens=NEW,
            sampling=s.model_copy(update={"seed": seed}),
            draft=DraftSettings(kind=drafter, k=2),
        )
        return generate(req, runtime, redis_client, names=names)

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(draws)))
    counts = Counter(tuple(g.token_ids) for g in got)
    return counts, sum(g.accepted_tokens for g in got), sum(g.drafted_tokens for g in got)


def chi2_pvalue(counts: Counter, probs: dict[tuple, float], n: int) -> float:
    """Pearson χ² p-value of observed sequences against exact probabilities (rare cells pooled)."""
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for cell, p in probs.items():
        if p * n >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(p * n)
        else:
            pool_o += counts.get(cell, 0)
            pool_e += p * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    assert sum(counts.values()) == n and set(counts) <= set(probs)
    total = sum(exp)
    return float(chisquare(obs, [e * n / total for e in exp]).pvalue)


@pytest.mark.parametrize(
    "s",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.5),
    ],
)
def test_warp_matches_transformers(s):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    scores = TemperatureLogitsWarper(s.temperature)(None, logits)
    if s.top_k:
        scores = TopKLogitsWarper(s.top_k)(None, scores)
    if s.top_p < 1:
        scores = TopPLogitsWarper(s.top_p)(None, scores)
    torch.testing.assert_close(warp(logits, s), scores.softmax(-1))


def _bigram_sim(P: torch.Tensor, Q: torch.Tensor, n: int, verifier) -> Counter:
    """Two tokens after token 0 from a bigram target P via one speculative round drafted by Q."""
    gen = torch.Generator().manual_seed(1)
    counts: Counter = Counter()
    for _ in range(n):
        d1 = int(torch.multinomial(Q[0], 1, generator=gen))
        d2 = int(torch.multinomial(Q[d1], 1, generator=gen))
        p = torch.stack([P[0], P[d1], P[d2]])
        a, nxt = verifier(p, torch.tensor([d1, d2]), torch.stack([Q[0], Q[d1]]), gen)
        seq = [d1, d2][:a] + [nxt]
        if len(seq) == 1:
            seq.append(int(torch.multinomial(P[seq[0]], 1, generator=gen)))
        counts[tuple(seq[:2])] += 1
    return counts


def _residual_from_p(p, drafts, q, gen):  # mutant: on rejection, resample p instead of max(0, p - q)
    for i in range(drafts.shape[0]):
        if float(torch.rand(1, generator=gen)) * float(q[i, drafts[i]]) >= float(p[i, drafts[i]]):
            return i, int(torch.multinomial(p[i], 1, generator=gen))
    return drafts.shape[0], int(torch.multinomial(p[-1], 1, generator=gen))


def _off_by_one(p, drafts, q, gen):  # mutant: bonus/correction drawn from the next position's row
    a, _ = verify_sampling(p, drafts, q, gen)
    return a, int(torch.multinomial(p[min(a + 1, p.shape[0] - 1)], 1, generator=gen))


def test_chi2_detects_broken_verifiers():
    """The χ² check used below passes the real verifier and fails plausible bugs."""
    g = torch.Generator().manual_seed(0)
    P = (torch.randn(4, 4, generator=g) * 1.5).softmax(-1)
    Q = (torch.randn(4, 4, generator=g) * 1.5).softmax(-1)
    exact = {(a, b): float(P[0, a] * P[a, b]) for a in range(4) for b in range(4)}
    n = 6000
    assert chi2_pvalue(_bigram_sim(P, Q, n, verify_sampling), exact, n) > 1e-3
    assert chi2_pvalue(_bigram_sim(P, Q, n, _residual_from_p), exact, n) < 1e-6
    assert chi2_pvalue(_bigram_sim(P, Q, n, _off_by_one), exact, n) < 1e-6


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, tails):
    root = tmp_path_factory.mktemp("sampling")
    target = save_tiny_model(root / "t", "qwen2", vocab_size=VOCAB, layers=2, hidden=32, init=0.15, seed=3)
    drafter = save_noisy_copy(target, root / "d", 0.6)
    names = tails.get(target, 1, 2)
    return target, drafter, names


def exact_distribution(target, s: SamplingParams) -> dict[tuple, float]:
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seqs = list(itertools.product(range(VOCAB), repeat=NEW))
    ids = torch.tensor([PROMPT + list(c) for c in seqs])
    with torch.no_grad():
        probs = warp(hf(ids).logits[:, len(PROMPT) - 1 : -1].reshape(-1, VOCAB), s).reshape(len(seqs), NEW, VOCAB)
    picked = probs.gather(-1, torch.tensor(seqs)[..., None])[..., 0]
    return {c: float(p) for c, p in zip(seqs, picked.prod(-1), strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("drafter", "s"),
    [  # plain temperature 1 with a draft model is proven by the MoE and hybrid χ² tests too (test_moe, test_hybrid)
        ("model", SamplingParams(temperature=0.8, top_k=4, top_p=0.9)),
        ("ngram", SamplingParams(temperature=1.0)),
    ],
)
def test_split_sampling_matches_target_distribution(small_vocab, redis_client, drafter, s):
    target, draft_model, names = small_vocab
    runtime = HeadRuntime.load(target, (0, 1), draft=draft_model if drafter == "model" else None)
    runtime.eos_token_ids = []
    counts, accepted, drafted = sample_draws(runtime, redis_client, names, s, drafter)
    assert 0 < accepted < drafted  # both acceptance and rejection happened
    assert chi2_pvalue(counts, exact_distribution(target, s), DRAWS) > 1e-3


def test_fixed_seed_reproduces(small_vocab, redis_client):
    target, draft_model, names = small_vocab
    runtime = HeadRuntime.load(target, (0, 1), draft=draft_model)
    runtime.eos_token_ids = []

    def run(seed: int) -> list[int]:
        req = GenerationRequest(
            prompt_ids=PROMPT,
            max_new_tokens=24,
            draft=DraftSettings(k=3),
            sampling=SamplingParams(temperature=1.0, seed=seed),
        )
        return generate(req, runtime, redis_client, names=names).token_ids

    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(6)}) > 1
