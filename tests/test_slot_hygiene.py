"""A slot is clean when it is reused: what one sequence left in a static KV slot never reaches the next one.

Masked attention multiplies stale keys/values by probabilities of 0, and 0 * NaN is NaN: before slots were
zeroed on release (workers/engine/kvcache.py, `KVPool.release`), one forged new-session packet with NaN hidden
rows, or one real float16 overflow, failed every later generation on its slot with NonFiniteError. Here, through
a real `TailWorker` (static engine, tiny models, packets as a head encodes them, `handle_many`):
- a forged 300-row packet, NaN from row 100, then a normal session on the same slot: HF generate's tokens;
- a float16 model built to overflow on one token: that job fails with NonFiniteError, the next on its slot
  gives what a clean tail gives;
- a batch of two where one session is NaN: the other succeeds, and so does the next session on the poisoned
  slot, batched with it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from schemas.keys import Keys
from schemas.macs import session_key
from schemas.packets import ErrorReply, Verdict, decode_tail_message, encode_round
from schemas.requests import SamplingParams
from schemas.settings import Settings
from workers.engine.kvcache import KVCache, StaticKVCache
from workers.engine.runner import Engine
from workers.engine.shard import Shard, load_shard
from workers.tail.server import TailWorker

SPLIT, LAYERS = 2, 4
SLOTS, MAX_LEN = 2, 384  # room for the forged packet's 300 rows
HEAD = dict(name="slot-hygiene", boot="5107c1ea", reply_timeout_s=60.0)  # the head the sessions name
TRIGGER, DIM = 319, 0  # the overflow model's token that overflows, and the residual dimension that carries it


def round_fields(header: dict, hidden: torch.Tensor, key: bytes) -> dict:
    """A round's stream fields as a head encodes them (one place to adapt if the packet changes)."""
    reply_to = Keys.head_reply_to(HEAD["name"], HEAD["boot"])  # type: ignore[arg-type]
    return encode_round({"head": HEAD, "reply_to": reply_to, **header}, {"hidden": hidden}, key)[1]


def reply_of(reply) -> Verdict | ErrorReply:
    assert reply is not None
    return decode_tail_message(reply.fields)


class Session:
    """One greedy generation driven by hand: the head shard's hidden states, one committed token per round."""

    def __init__(self, head: Shard, sid: str, prompt: list[int], new: int) -> None:
        self.head, self.sid, self.new = head, sid, new
        self.key, self.cache = session_key(), KVCache()
        self.pending, self.start, self.round = list(prompt), 0, 0
        self.tokens: list[int] = []
        self.batches: list[float] = []  # rounds in the tail's forward, per verdict
        self.error: ErrorReply | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or len(self.tokens) >= self.new

    def fields(self) -> dict:
        with torch.inference_mode():
            hidden = self.head(torch.tensor(self.pending), self.start, self.cache)
        return self.packet(hidden)

    def packet(self, hidden: torch.Tensor) -> dict:
        header = dict(
            session_id=self.sid,
            round_id=self.round,
            start_pos=self.start,
            input_ids=self.pending,
            draft_ids=[],
            sampling=SamplingParams(),
            eos_token_ids=[],
            max_new=self.new - len(self.tokens),
            q_kind="none",
        )
        return round_fields(header, hidden, self.key)

    def take(self, reply) -> None:
        msg = reply_of(reply)
        if isinstance(msg, ErrorReply):
            self.error = msg
            return
        assert msg.round_id == self.round and msg.accepted == 0, msg
        self.tokens += msg.tokens
        self.batches.append(msg.timings.get("batch", 0.0))
        self.start += len(self.pending)
        self.pending, self.round = msg.tokens[-1:], self.round + 1


def step(worker: TailWorker, sessions: list[Session]) -> list[Session]:
    """One round of each running session, batched into one `handle_many`; the sessions that ran."""
    live = [s for s in sessions if not s.done]
    for s, reply in zip(live, worker.handle_many([s.fields() for s in live]), strict=True):
        s.take(reply)
    return live


def run_together(worker: TailWorker, sessions: list[Session]) -> None:
    """Every session's rounds, those still running batched into one `handle_many` per round."""
    while step(worker, sessions):
        pass


def forged(sid: str, hidden_size: int, rows: int = 300, nan_from: int = 100) -> Session:
    """A new session's packet as an attacker writes it (no head involved): `rows` ids, NaN rows from `nan_from`."""
    s = Session(None, sid, [int(i) for i in torch.randint(1, 300, (rows,))], 4)  # type: ignore[arg-type]
    hidden = torch.randn(rows, hidden_size)
    hidden[nan_from:] = float("nan")
    s.fields = lambda: s.packet(hidden)  # type: ignore[method-assign]
    return s


class Tail:
    """A TailWorker on a static engine of SLOTS slots, in this process; the slots it hands out, in order."""

    def __init__(self, target: Path, r, dtype: torch.dtype = torch.float32) -> None:
        shard = load_shard(target, (SPLIT, LAYERS), embed=False, head=True, dtype=dtype)
        names = Keys(f"hyg-{secrets.token_hex(4)}")
        if hasattr(names, "head"):  # the head is alive, as a running head says (workers/tail/liveness.py)
            r.set(names.head(HEAD["name"]), HEAD["boot"], ex=600)
        engine = Engine(shard, Settings(engine={"static": True, "max_len": MAX_LEN}), slots=SLOTS, label="tail")
        self.worker = TailWorker(shard, r, names=names, engine=engine, settings=Settings())
        self.slots: list[int] = []
        acquire = engine.acquire

        def spy(*args, **kwargs):
            cache = acquire(*args, **kwargs)
            if isinstance(cache, StaticKVCache):
                self.slots.append(cache.slot)
            return cache

        engine.acquire = spy  # type: ignore[method-assign]


def head_shard(target: Path, dtype: torch.dtype = torch.float32) -> Shard:
    return load_shard(target, (0, SPLIT), embed=True, head=False, dtype=dtype)


def clean_run(target: Path, r, prompt: list[int], new: int, dtype: torch.dtype = torch.float32) -> list[int]:
    """What a fresh tail (never-used slots) generates for this prompt."""
    s = Session(head_shard(target, dtype), "clean-ref", prompt, new)
    run_together(Tail(target, r, dtype).worker, [s])
    assert s.error is None, s.error
    return s.tokens


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randint(1, 300, (n,), generator=g)]


def test_forged_nan_session_leaves_its_slot_clean(models, hf_models, redis_client):
    """The issue's attack: 300 ids, NaN from row 100, then a normal session long enough to attend over positions
    100+ of the same slot: it generates HF generate's tokens (before: NonFiniteError)."""
    target = models["qwen2"].target
    tail = Tail(target, redis_client)
    bad = forged("forged-0", tail.worker.shard.config.hidden_size)
    run_together(tail.worker, [bad])
    assert bad.error is not None and bad.error.non_finite, bad.error
    prompt = prompt_ids(110, 1)
    good = Session(head_shard(target), "victim-0", prompt, 8)
    run_together(tail.worker, [good])
    assert tail.slots == [tail.slots[0]] * 2  # the victim got the forged session's slot
    assert good.error is None, good.error
    ids = torch.tensor([prompt])
    want = hf_models["qwen2"].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
    assert good.tokens == want[0, len(prompt) :].tolist() == clean_run(target, redis_client, prompt, 8)


@pytest.fixture(scope="module")
def overflowing(models, tmp_path_factory) -> Iterator[Path]:
    """A copy of the tiny Qwen2 model that overflows float16 on one token only: residual dimension DIM is zero
    for every token but TRIGGER (no layer writes it), and one MLP channel of layer SPLIT (the tail's first)
    squares it: ~1e7 for TRIGGER, past float16's 65504, and exactly 0 for every other token."""
    out = tmp_path_factory.mktemp("overflow-token") / "model"
    model = AutoModelForCausalLM.from_pretrained(models["qwen2"].target, dtype=torch.float32)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, DIM] = 0.0
        embed[TRIGGER, DIM] = 10.0  # about the residual's RMS here
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[DIM] = 0.0
            layer.mlp.down_proj.weight[DIM] = 0.0
        mlp = model.model.layers[SPLIT].mlp
        for proj in (mlp.gate_proj, mlp.up_proj):
            proj.weight[0] = 0.0
            proj.weight[0, DIM] = 3000.0
    model.save_pretrained(out)
    PreTrainedTokenizerFast.from_pretrained(models["qwen2"].target).save_pretrained(out)
    yield out


def test_float16_overflow_fails_its_own_job_only(overflowing, redis_client):
    """A real overflow (no forged input): the job whose prompt holds TRIGGER fails with a non-finite error; the
    next job, on the same slot and attending over the positions the overflow wrote, generates what a clean
    tail does (before: NonFiniteError too)."""
    f16 = torch.float16
    tail, head = Tail(overflowing, redis_client, f16), head_shard(overflowing, f16)
    hot = Session(head, "hot-0", [*prompt_ids(40, 2), TRIGGER, *prompt_ids(5, 3)], 6)  # NaN keys/values at 40
    run_together(tail.worker, [hot])
    assert hot.error is not None and hot.error.non_finite and "float16" in hot.error.error, hot.error
    prompt = prompt_ids(20, 4)  # writes positions 0..27, attends over 0..63
    good = Session(head, "cool-0", prompt, 8)
    run_together(tail.worker, [good])
    assert tail.slots == [tail.slots[0]] * 2
    assert good.error is None, good.error
    assert TRIGGER not in good.tokens  # (else this job would overflow too)
    assert good.tokens == clean_run(overflowing, redis_client, prompt, 8, f16)


def test_nan_session_in_a_batch_fails_alone(models, redis_client):
    """A batch of two new sessions, one NaN: the other succeeds; then a new session on the NaN one's slot, in
    one batch with the first one's later rounds: both give a clean tail's tokens."""
    target = models["qwen2"].target
    tail, head = Tail(target, redis_client), head_shard(target)
    first, second = prompt_ids(90, 5), prompt_ids(120, 6)
    bad = forged("forged-1", tail.worker.shard.config.hidden_size)
    a = Session(head, "batch-a", first, 6)
    step(tail.worker, [bad, a])  # round 0 of both: one batched forward
    assert bad.error is not None and bad.error.non_finite, bad.error
    assert a.error is None and len(a.tokens) == 1 and a.batches == [2], (a.error, a.batches)
    b = Session(head_shard(target), "batch-b", second, 6)
    run_together(tail.worker, [a, b])
    assert tail.slots[2] == tail.slots[0]  # b took the forged session's slot
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.tokens == clean_run(target, redis_client, first, 6)
    assert b.tokens == clean_run(target, redis_client, second, 6)


def test_a_forged_packet_naming_a_session_does_not_push_its_round_out_of_the_batch(models, redis_client):
    """In one read: a packet naming session v under the wrong key, then v's own round, then w's. The forgery is
    refused, and v's round still runs in the batch with w's; a session's second authentic packet in one read
    waits for the batch (two of its rounds never share a forward)."""
    target = models["qwen2"].target
    tail, head = Tail(target, redis_client), head_shard(target)
    v, w = Session(head, "v", prompt_ids(12, 2), 4), Session(head, "w", prompt_ids(9, 3), 4)
    step(tail.worker, [v, w])  # both sessions open, with their keys
    fake = Session(head, "v", [1], 4)
    fake.round, fake.start = v.round, v.start
    forged_fields = fake.packet(torch.randn(1, head.config.hidden_size))  # v's round, under another key
    v_fields, w_fields = v.fields(), w.fields()
    replies = tail.worker.handle_many([forged_fields, v_fields, w_fields])
    assert replies[0] is None  # refused, dead-lettered: no reply under a key it does not hold
    v.take(replies[1])
    w.take(replies[2])
    assert v.error is None and w.error is None
    assert v.batches[-1] == w.batches[-1] == 2.0  # v's round ran with w's
    again = tail.worker.handle_many([v.fields(), v_fields])  # v's next round, then its last one again
    v.take(again[0])
    assert v.error is None and v.batches[-1] == 1.0
    assert again[1] is None  # after the batch, alone: a late round of v, dead-lettered without a reply
