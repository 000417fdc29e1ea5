"""More than two workers (workers/stage/server.py, workers/head/routes.py): a head, middle stages and a tail, each a
real process but the head, on a real Redis. Greedy generations through 3 and 4 workers equal HF generate, sessions
pin to the stages their first verdict names, and a forged entry on a stage's stream is refused there."""

from __future__ import annotations

import itertools
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from relay_broker.connection import connect
from schemas.keys import Keys
from schemas.requests import DraftSettings, GenerationRequest, GenerationResult
from tests.conftest import PROMPTS
from tests.job_env import reference, spawn, tail_args

NEW = 8
_made = itertools.count()


def _stage_args(target, layers: tuple[int, int], url: str, prefix: str, name: str) -> list[str]:
    where = ["--target", str(target), "--layers", f"{layers[0]}:{layers[1]}", "--redis-url", url, "--prefix", prefix]
    return [sys.executable, "-m", "producer", "stage", *where, "--threads", "1", "--name", name]


@pytest.fixture
def chain(models, redis_server, tmp_path):
    """Start a tail and the middle stages for `cuts` (the layers where each worker begins after the head) on a fresh
    prefix; yields a function that does so and returns the prefix's names; stops them after the test."""
    procs = []

    def start(cuts: list[int], replicas: int = 1) -> Keys:
        from producer.local import wait_for_tails

        ms = models["qwen2"]
        names = Keys(f"stages{next(_made)}-{os.getpid()}")
        r = connect(redis_server.url)
        bounds = [*cuts, ms.n_layers]
        tail = spawn(tail_args(ms.target, (bounds[-2], bounds[-1]), redis_server.url, names.prefix, ["--threads", "1"]),
                     tmp_path / "tail.log")  # fmt: skip
        procs.append(tail)
        for (a, b), i in itertools.product(itertools.pairwise(bounds[:-1]), range(replicas)):
            args = _stage_args(ms.target, (a, b), redis_server.url, names.prefix, f"st{a}-{i}")
            procs.append(spawn(args, tmp_path / f"s{a}-{i}.log"))
        wait_for_tails(r, names, proc=tail)
        want = {f"{a}:{b}" for a, b in itertools.pairwise(bounds[:-1])}
        deadline = time.monotonic() + 60
        while {m.decode().split()[1] for m in r.zrange(names.stages, 0, -1)} != want or (
            r.zcard(names.stages) < replicas * len(want)
        ):
            assert time.monotonic() < deadline, "the stages did not announce themselves"
            time.sleep(0.1)
        time.sleep(0.5)  # their consumer groups are made before they announce: reading by now
        start.procs = procs  # type: ignore[attr-defined]
        return names

    yield start
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(30)


@pytest.mark.parametrize("cuts", [[1, 3], [1, 2, 3]], ids=["3 workers", "4 workers"])
def test_greedy_through_middle_stages_equals_hf_generate(cuts, chain, models, redis_client, hf_models, tokenizers):
    """A head (layers 0:1, a draft model) routes through the announced stages to the tail: six generations at once,
    each equal to HF generate; each session's later rounds went to the stages and tail its first verdict named, and
    its result times each middle stage (`timings.hop_ms`, one entry a stage)."""
    from workers.head.runtime import HeadRuntime, new_generation

    ms = models["qwen2"]
    names = chain(cuts)
    runtime = HeadRuntime.load(ms.target, (0, cuts[0]), draft=ms.drafter)
    prompts = PROMPTS[:6]
    gens = []

    def one(p: str) -> GenerationResult:
        req = GenerationRequest(prompt=p, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(k=3))
        gen = new_generation(req, runtime, redis_client, names=names)
        gens.append(gen)
        return gen.run()

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    want = [reference(hf_models["qwen2"], tokenizers["qwen2"], p, NEW) for p in prompts]
    assert [r.token_ids for r in results] == want
    stages = [f"stage:{a}-{b}" for a, b in itertools.pairwise(cuts)]
    for gen in gens:  # pinned: each stage's own stream, then the tail's
        assert [h.split("@")[0] for h in gen.hops] == [*stages, "tail"] and all("@" in h for h in gen.hops)
    for r in results:  # each stage's time with the rounds, summed over them
        hops = r.timings.hop_ms
        assert len(hops) == len(stages) and all(0 < h < r.timings.total_ms for h in hops), (hops, r.timings)


def test_a_forged_entry_on_a_stage_stream_is_refused(chain, models, redis_client, hf_models, tokenizers):
    """An opening round on a stage's shared stream whose MAC does not verify is dead-lettered before any cache is
    touched; the stage goes on serving, and a generation through it is exact."""
    from schemas.packets import HEADER, HeadRef
    from tests.relay_util import opening_round
    from workers.head.routes import chain as route_chain
    from workers.head.runtime import HeadRuntime, generate

    ms = models["qwen2"]
    names = chain([1, 3])
    assert route_chain(1, {(1, 3)}) == ["stage:1-3", "tail"] and route_chain(1, set()) == ["tail"]
    head = HeadRef(name="forger", boot="0123456789abcdef", reply_timeout_s=5)
    forged = {**opening_round("f" * 24, head, hidden_size=64), b"m": bytes(32)}  # a MAC that does not verify
    redis_client.xadd(names.stage_shared((1, 3)), forged)
    deadline = time.monotonic() + 20
    while not any(b"does not verify" in f.get(HEADER, b"") for _, f in redis_client.xrange(names.dead_letters)):
        assert time.monotonic() < deadline, "the forged entry was not dead-lettered"
        time.sleep(0.1)
    runtime = HeadRuntime.load(ms.target, (0, 1))
    req = GenerationRequest(prompt=PROMPTS[0], max_new_tokens=NEW, chat_template=False)
    got = generate(req, runtime, redis_client, names=names).token_ids
    assert got == reference(hf_models["qwen2"], tokenizers["qwen2"], PROMPTS[0], NEW)


def test_a_middle_stage_killed_mid_batch_changes_no_output(chain, models, redis_client, hf_models, tokenizers):
    """Two replicas of the middle range; one is SIGKILLed while a batch runs: the sessions pinned to it hear nothing
    within the reply timeout and are replayed (prompt and committed tokens from position 0) onto the shared stream,
    which the other replica serves. Every greedy output still equals HF generate."""
    from schemas.settings import Settings
    from workers.head.runtime import HeadRuntime, new_generation

    ms = models["qwen2"]
    names = chain([1, 3], replicas=2)
    settings = Settings(relay={"reply_timeout_s": 3.0})
    runtime = HeadRuntime.load(ms.target, (0, 1), draft=ms.drafter, settings=settings)
    prompts, new = PROMPTS[:6], 24
    gens = []

    def one(p: str) -> list[int]:
        req = GenerationRequest(prompt=p, max_new_tokens=new, chat_template=False, draft=DraftSettings(k=2))
        gen = new_generation(req, runtime, redis_client, names=names)
        gens.append(gen)
        return gen.run().token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        deadline = time.monotonic() + 30
        while not (going := [g for g in gens if g.rounds >= 2 and g.pinned]):
            assert time.monotonic() < deadline, "no generation got going"
            time.sleep(0.02)
        held_by = going[0].hops[0].partition("@")[2]  # the replica that holds a session in flight
        victim = next(p for p in chain.procs if held_by in p.args)  # type: ignore[attr-defined]
        victim.kill()
        got = [f.result(timeout=120) for f in futures]
    assert got == [reference(hf_models["qwen2"], tokenizers["qwen2"], p, new) for p in prompts]
    assert sum(g.replays for g in gens) >= 1  # the dead replica's sessions were replayed


def test_a_gone_heads_sessions_are_freed_at_every_stage(chain, redis_client, hf_models, tmp_path):
    """A session a head opened through two middle stages and the tail, then left (no close: a SIGKILLed head sends
    none, and a stage never hears a verdict): once the head's liveness key has expired, as a killed head's does,
    and the session was silent for the head's reply timeout, every stage frees it as the tail does
    (workers/tail/liveness.py, which a stage runs as a tail does) and says so in its log."""
    from schemas.macs import session_key
    from schemas.packets import HeadRef, encode_round
    from schemas.requests import SamplingParams
    from tests.relay_util import announce, open_replies, replies

    names = chain([1, 2, 3])
    head = HeadRef(name="gone-head", boot="00112233445566aa", reply_timeout_s=1.0)
    reply_to = Keys.head_reply_to(head.name, head.boot)
    stream = open_replies(redis_client, names, reply_to)
    header = dict(session_id="g" * 24, head=head, reply_to=reply_to, round_id=0, start_pos=0, input_ids=[5, 6, 7],
                  draft_ids=[], sampling=SamplingParams(), eos_token_ids=[], max_new=8, q_kind="none", layer=1,
                  route=["stage:2-3", "tail"])  # fmt: skip
    width = hf_models["qwen2"].config.hidden_size
    announce(redis_client, names, head)
    _, fields = encode_round(header, {"hidden": torch.randn(3, width)}, session_key())
    redis_client.xadd(names.stage_shared((1, 2)), fields)
    assert replies(redis_client, stream, {"g" * 24}), "the round did not reach the tail"
    # the key expires 3 s on: meanwhile every worker's check (each head_check_s, 1 s) saw it name the session's boot
    announce(redis_client, names, head, ttl_s=3.0)
    logs = {"stage 1:2": tmp_path / "s1-0.log", "stage 2:3": tmp_path / "s2-0.log", "tail": tmp_path / "tail.log"}
    said = "dropped 1 session(s): their head gone-head was silent for over 1s"
    deadline = time.monotonic() + 30
    while missing := [w for w, log in logs.items() if said not in log.read_text()]:
        assert time.monotonic() < deadline, f"{missing} kept the gone head's session"
        time.sleep(0.2)
