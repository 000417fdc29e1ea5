"""One worker's credential cannot harm another's jobs (issue 56), tried as an adversary would: real tail and head
processes on a TLS redis-server 7 loaded with the rendered ACL file, each worker with a user of its own
(`head-iso-a`, `tail-iso-t1`), and each attack sent with a stolen credential while a batch of the victim's jobs
runs. Every output equals the undisturbed one (Hugging Face greedy `generate`, which an undisturbed split run
equals token for token) and no job fails.

- N1: the shared `head` user (kept for setups that accept the risk) SETs the victim's liveness key to another boot
  ten times a second: its sessions are no longer dropped (before: 3/8 jobs failed for good).
- N2: a tail credential XADDs the last possible entry id to the victim's reply stream: the head moves to a fresh
  stream and its jobs finish (before: every later reply failed on every tail; all its jobs stalled).
- N3: a head credential reads the victim's reply stream through the old shared group name (`head`) in a loop:
  nothing is taken (before: 4 stolen verdicts pushed 7 jobs into RQ retries).
- N4: 16 self-signed opening rounds of a made-up head claiming a day's reply timeout fill every cache of the tail:
  the victim's jobs start within about one reply timeout (before: about 600 s).
- N5: another named tail's credential EXPIREs the victim tail's own request stream: refused.
- N6: a tail credential puts 20,000 junk entries on the victim's reply stream: a burst and a rate of them are
  dead-lettered, the rest counted (before: three in four became records, cycling the audit trail).
- N7: a head credential puts 4 entries of 48 MB on the shared request stream: the tail reads them one at a time
  (its peak memory grows by about one entry's worth, not several).

Needs Debian's redis-server 7 with TLS and the openssl CLI (as tests/test_security.py); they skip without.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from producer.client import Client
from producer.local import wait_for_tails
from schemas.keys import Keys
from schemas.packets import HeadRef
from schemas.requests import GenerationRequest
from tests.job_env import head_worker, spawn, tail_args
from tests.relay_util import opening_round
from tests.secure_redis import PREFIX, SPLIT, Secured
from workers.tiny_models import PROMPTS, build_tokenizer, save_tiny_model

QUEUE, N_LAYERS, NEW, JOBS, TIMEOUT_S = "isoq", 4, 12, 8, 3.0
NAMES = Keys(PREFIX)
MADE_UP = HeadRef(name="nobody", boot="0badf00d", reply_timeout_s=86400)  # a head that never ran, asking for a day


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2", tokenizer=build_tokenizer())


@pytest.fixture(scope="module")
def references(tiny) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(tiny)
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS[:JOBS]:
        ids = torch.tensor([tok.encode(prompt)])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


class Victim:
    """A tail (user tail-iso-t1, 16 caches) and the victim head (user head-iso-a), each a process of its own."""

    def __init__(self, s: Secured, model: Path, logdir: Path) -> None:
        self.s, self.admin, self.logdir = s, s.client("admin"), logdir
        env = {"SHARDFLOW_RELAY__REPLY_TIMEOUT_S": str(TIMEOUT_S), "SHARDFLOW_RELAY__HEAD_CHECK_S": "0.5"}
        args = tail_args(model, (SPLIT, N_LAYERS), s.url("tail-iso-t1"), PREFIX, ["--threads", "1"])
        self.tail = spawn([*args, "--name", "iso-t1", "--slots", "16"], logdir / "tail.log", {**os.environ, **env})
        wait_for_tails(self.admin, NAMES, proc=self.tail)  # type: ignore[arg-type]
        self.head = head_worker(model, s.url("head-iso-a"), QUEUE, PREFIX, logdir / "head.log", "iso-a")
        deadline = time.monotonic() + 90
        while not self.admin.exists(NAMES.model_info(QUEUE)) or not self.admin.scard(f"rq:workers:{QUEUE}"):
            assert self.head.poll() is None, (logdir / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "head worker did not start"
            time.sleep(0.2)
        self.client = Client(s.client("producer"), prefix=PREFIX, queue=QUEUE)
        self.replays = 0

    def reply_stream(self) -> str:
        """The victim head's reply stream now: of the streams named for it (`reply:head.iso-a.BOOT[.EPOCH]`, made by
        its beacon once it announced itself: a first batch is run where none is there yet), the latest epoch."""
        pattern = f"{NAMES.reply('head.iso-a.')}*"
        if not list(self.admin.scan_iter(match=pattern)):
            self.run()
        streams = sorted(k.decode() for k in self.admin.scan_iter(match=pattern))
        return max(streams, key=lambda k: (len(k), k))

    def run(self, attack: Callable[[threading.Event], None] | None = None) -> tuple[list[list[int] | None], float]:
        """A batch of the victim's jobs, with `attack` running beside it until the batch ends; each job's tokens
        (None: not finished) and the batch's seconds. `replays` then holds the batch's replays onto a tail and
        tokens resumed from checkpoints (an RQ retry): what an attack cost that the output does not show."""
        stop = threading.Event()
        attacker = threading.Thread(target=attack, args=(stop,), daemon=True) if attack else None
        if attacker:
            attacker.start()
        t0 = time.monotonic()
        requests = [GenerationRequest(prompt=p, max_new_tokens=NEW, chat_template=False) for p in PROMPTS[:JOBS]]
        batch = self.client.enqueue(requests)
        try:
            views = self.client.wait(batch.job_ids, timeout=120)
        finally:
            stop.set()
            if attacker:
                attacker.join(30)
        spent = time.monotonic() - t0
        results = [v.result for v in views if v.status == "finished" and v.result]
        self.replays = sum(r.get("replays", 0) + r.get("resumed_tokens", 0) for r in results)
        return [v.result["token_ids"] if v.status == "finished" and v.result else None for v in views], spent

    def close(self) -> None:
        for p in (self.head, self.tail):
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def victim(secured, tiny, tmp_path_factory) -> Iterator[Victim]:
    v = Victim(secured, tiny, tmp_path_factory.mktemp("iso-logs"))
    yield v
    v.close()


def _flood(stop: threading.Event, every_s: float, act: Callable[[], object]) -> None:
    while not stop.is_set():
        try:
            act()
        except redis.RedisError:
            pass
        stop.wait(every_s)


def test_n1_a_set_of_a_heads_key_fails_none_of_its_jobs(victim, references):
    attacker = victim.s.client("head")  # the shared head user: may SET every head's key (the risk it accepts)
    key = NAMES.head("iso-a")
    got, _ = victim.run(lambda stop: _flood(stop, 0.1, lambda: attacker.set(key, secrets.token_hex(8), px=30000)))
    assert got == references and victim.replays == 0  # no session dropped (before: each SET cost replays)


def test_n2_a_wedged_reply_stream_moves_the_head_to_a_fresh_one(victim, references):
    attacker = victim.s.client("tail")
    stream = victim.reply_stream()
    attacker.execute_command("XADD", stream, "18446744073709551615-18446744073709551615", "junk", "1")
    with pytest.raises(redis.ResponseError, match="exhausted"):  # every later reply on it would fail
        attacker.execute_command("XADD", stream, "*", "junk", "2")
    got, _ = victim.run()
    assert got == references
    assert victim.reply_stream() != stream


def test_n3_another_heads_reads_take_none_of_its_verdicts(victim, references):
    thief = victim.s.client("head")
    stream = victim.reply_stream()

    def steal() -> None:
        thief.xreadgroup("head", "thief", {stream: ">"}, count=4)

    got, _ = victim.run(lambda stop: _flood(stop, 0.01, steal))
    assert got == references and victim.replays == 0
    with pytest.raises(redis.exceptions.NoPermissionError):
        victim.s.client("head-iso-b").xreadgroup("head.x", "thief", {stream: ">"}, count=4)


def test_n4_forged_sessions_hold_the_tail_one_reply_timeout_at_most(victim, references, tiny):
    from transformers import AutoConfig

    hidden = AutoConfig.from_pretrained(tiny).hidden_size
    attacker = victim.s.client("head-iso-b")
    for i in range(16):
        forged = opening_round(f"forged-{secrets.token_hex(4)}-{i}", MADE_UP, hidden, max_new=100)
        attacker.xadd(NAMES.shared_requests, forged)
    time.sleep(1.0)  # the tail opened them: every cache is taken
    got, spent = victim.run()
    assert got == references
    assert spent < TIMEOUT_S + 20, spent  # an innocent job waits at most about one reply timeout (before: ~600 s)


def test_n5_a_tail_cannot_expire_another_tails_stream(victim, references):
    own = NAMES.tail_requests("iso-t1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        victim.s.client("tail-iso-t2").expire(own, 0)
    got, _ = victim.run()
    assert got == references and victim.replays == 0 and victim.admin.ttl(own) > 0


def test_n6_a_junk_flood_on_a_reply_stream_is_dead_lettered_at_a_capped_rate(victim, references):
    attacker, dead = victim.s.client("tail"), NAMES.dead_letters
    before = victim.admin.xlen(dead)
    stream = victim.reply_stream()

    def flood(stop: threading.Event) -> None:
        for at in range(0, 20_000, 1000):
            pipe = attacker.pipeline(transaction=False)
            for i in range(at, at + 1000):
                pipe.xadd(stream, {"junk": str(i)}, nomkstream=True)
            pipe.execute()

    got, spent = victim.run(flood)
    assert got == references and victim.replays == 0
    time.sleep(1.0)
    written = victim.admin.xlen(dead) - before
    assert written <= 100 + 10 * (spent + 2), written  # the burst, then 10 a second (before: most of 20,000)


def _peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_n7_huge_entries_are_read_one_at_a_time(victim, references):
    attacker, size = victim.s.client("head-iso-b"), 48 << 20
    assert victim.run()[0] == references  # the tail warm: its peak is what serving takes
    peak = _peak_rss_kb(victim.tail.pid)
    pipe = attacker.pipeline(transaction=False)
    for i in range(4):
        pipe.xadd(NAMES.shared_requests, {"junk": bytes([i]) * size})
    pipe.execute()
    deadline = time.monotonic() + 60
    while victim.admin.xlen(NAMES.shared_requests) and time.monotonic() < deadline:  # taken, refused, deleted
        time.sleep(0.1)
    grown_mb = (_peak_rss_kb(victim.tail.pid) - peak) / 1024

    got, _ = victim.run()
    assert got == references
    # one entry at a time: the client's read buffer and the entry (2 x 48 MB), never four entries (+240 MB)
    assert grown_mb < 3 * size / (1 << 20), grown_mb
