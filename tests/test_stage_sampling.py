"""Lossless sampling through a middle stage (workers/stage/server.py): a head (layer 0:1, a draft model), a stage
(1:2) and a tail (2:3), the stage and the tail real processes on a real Redis, sample from the target's own
distribution: a χ² test of drawn sequences against the exact one, as tests/test_sampling.py makes it."""

from __future__ import annotations

import time

import pytest

from relay_broker.connection import connect
from schemas.requests import SamplingParams
from tests.job_env import spawn
from tests.test_sampling import VOCAB, chi2_pvalue, exact_distribution, sample_draws
from tests.test_stages import _stage_args
from workers.tiny_models import save_noisy_copy, save_tiny_model

# 500 draws: with this model (init 0.3: less flat than test_sampling's 0.15, whose sequences differ too little for
# few draws to tell a wrong context from the right one) a χ² at 1e-3 tells the target's distribution from the
# drafter's every time, and from one whose last token saw a stale extra row 97% of the time (simulated, 30 times)
DRAWS = 500


@pytest.fixture(scope="module")
def through_a_stage(tmp_path_factory, tails, redis_server):
    """A 3-layer small-vocabulary target and its noisy draft copy; a tail serving layers 2:3 (the session's tails,
    retired after this module) and a stage serving 1:2 on its prefix, announced."""
    root = tmp_path_factory.mktemp("stage-sampling")
    target = save_tiny_model(root / "t", "qwen2", vocab_size=VOCAB, layers=3, hidden=32, init=0.3, seed=3)
    drafter = save_noisy_copy(target, root / "d", 0.6)
    names = tails.get(target, 2, 3)
    stage = spawn(_stage_args(target, (1, 2), redis_server.url, names.prefix, "st1"), root / "stage.log")
    try:
        r, deadline = connect(redis_server.url), time.monotonic() + 60
        while not r.zcard(names.stages):
            assert time.monotonic() < deadline and stage.poll() is None, "the stage did not announce itself"
            time.sleep(0.1)
        time.sleep(0.5)  # its consumer group is made before it announces: reading by now
        yield target, drafter, names
    finally:
        stage.terminate()
        stage.wait(30)


@pytest.mark.slow
def test_sampling_through_a_middle_stage_matches_target_distribution(through_a_stage, redis_client):
    """Seeded draws (32 in flight, batched at the head, the stage and the tail) of 3 tokens through head, stage and
    tail, drafts both accepted and rejected (the stage rolls its cache back to where each round starts): their
    sequences pass a χ² test against the exact distribution of the warped target."""
    from workers.head.runtime import HeadRuntime

    target, drafter, names = through_a_stage
    s = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    runtime = HeadRuntime.load(target, (0, 1), draft=drafter)
    runtime.eos_token_ids = []
    assert runtime.routes.route(redis_client, names) == ["stage:1-2", "tail"]
    counts, accepted, drafted = sample_draws(runtime, redis_client, names, s, draws=DRAWS)
    assert 0 < accepted < drafted  # both acceptance and rejection happened
    assert chi2_pvalue(counts, exact_distribution(target, s), DRAWS) > 1e-3
