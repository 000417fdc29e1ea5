"""Integrity under forged input (issue 24): rounds and replies are authenticated per session, and a tail frees
the sessions of heads that are gone.

- A forged round for a live session, at its right round and position (random hidden states, float64 ones, an
  "opening" with the forger's own key), sent before the real one: refused into the dead-letter stream, the
  output unchanged, no replay spent (before: the tail verified the forged round and the victim's output
  changed, with 0 replays and no error).
- Forged replies of every kind in a live reply stream (non-finite with no round id or the right one, four
  retryable errors, busy, plain errors, a wrong echo, verdicts of 0 accepted + 1 token, signed or not): the job
  finishes identical, with no replay (before: the first failed the job for good; four used up the replays).
- A tail trusts nothing another process writes to end a session at once (issue 56): a head that restarts under
  its name frees its old sessions once they have been silent longer than the reply timeout, as a killed one's;
  a SET of a head's key to another boot costs its live sessions nothing; a forger claiming a head's new boot frees
  nothing; sessions of a head that never announced itself go after the tail's own reply timeout, however long
  their packets claim and however often they speak; an opening round of a session already served is answered
  with its final verdict, never served again; a head past its share of the caches while another waits gets
  no new one.
"""

from __future__ import annotations

import secrets
import time

import torch

from schemas.dead_letters import DeadLetterRecord
from schemas.groups import pack_group
from schemas.keys import Keys
from schemas.macs import session_key
from schemas.packets import HEADER, MAC, ErrorReply, HeadRef, Verdict, decode_tail_message, encode_message, encode_round
from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from schemas.settings import Settings
from tests.conftest import PROMPTS
from tests.relay_util import opening_round
from tests.test_parity import NEW, head_for, reference
from workers.engine.runner import Engine
from workers.engine.shard import load_shard
from workers.head.runtime import generate
from workers.tail.server import TailWorker

FAMILY, SPLIT = "qwen2", 2


def _request(i: int) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPTS[i], max_new_tokens=NEW, chat_template=False, draft=DraftSettings(k=4))


def _dead(r, names: Keys) -> list[DeadLetterRecord]:
    return [DeadLetterRecord.model_validate_json(f[HEADER]) for _, f in r.xrange(names.dead_letters)]


def test_a_forged_round_for_a_live_session_changes_nothing(models, hf_models, tokenizers, tails, redis_client):
    ms = models[FAMILY]
    tail_name = "integrity-rounds"
    names = tails.get(ms.target, SPLIT, ms.n_layers, ("--name", tail_name))
    runtime = head_for(ms, SPLIT, ms.drafter)
    hidden_size = runtime.shard.config.hidden_size
    prompt = tokenizers[FAMILY].encode(PROMPTS[3])
    sid, forged = f"victim-{secrets.token_hex(4)}", [0]

    def forge(new: list[int], generated: list[int]) -> None:
        """Before the head sends its next round: the forger's, at the same round id and position."""
        forged[0] += 1
        start = len(prompt) + len(generated) - 1
        base = dict(
            session_id=sid,
            head=runtime.beacons.ref,
            reply_to=Keys.head_reply_to(runtime.beacons.ref.name, runtime.beacons.ref.boot),
            round_id=forged[0],
            sampling=SamplingParams(),
            eos_token_ids=[0],
            max_new=max(NEW - len(generated), 1),
            q_kind="none",
            draft_ids=[],
        )
        own_key = session_key()
        packets = [
            encode_round(
                {**base, "start_pos": start, "input_ids": generated[-1:]},
                {"hidden": torch.randn(1, hidden_size)},
                own_key,
            )[1],
            encode_round(
                {**base, "start_pos": start, "input_ids": generated[-1:]},
                {"hidden": torch.randn(1, hidden_size, dtype=torch.float64)},
                own_key,
            )[1],
            # an "opening" of the live session with the forger's own key: a replay of its whole sequence
            encode_round(
                {**base, "start_pos": 0, "input_ids": prompt + generated, "replay": True},
                {"hidden": torch.randn(len(prompt) + len(generated), hidden_size)},
                own_key,
            )[1],
        ]
        for fields in packets:
            for stream in (names.tail_requests(tail_name), names.shared_requests):
                redis_client.xadd(stream, fields, maxlen=1000, approximate=True)

    result = generate(_request(3), runtime, redis_client, names=names, session_id=sid, on_tokens=forge)
    assert result.token_ids == reference(FAMILY, hf_models[FAMILY], tokenizers[FAMILY])[3]
    assert result.replays == 0 and forged[0] >= 3
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        refused = [d for d in _dead(redis_client, names) if d.session_id == sid and "MAC" in d.reason]
        if len(refused) >= 3 * 2 * (forged[0] - 1):  # every forged packet of the rounds that followed one
            break
        time.sleep(0.2)
    assert len(refused) >= 3 * 2 * (forged[0] - 1), len(refused)


def test_forged_replies_of_every_kind_never_fail_or_change_a_job(models, hf_models, tokenizers, tails, redis_client):
    ms = models[FAMILY]
    names = tails.get(ms.target, SPLIT, ms.n_layers, ("--name", "integrity-replies"))
    runtime = head_for(ms, SPLIT, ms.drafter)
    sid, rounds = f"replied-{secrets.token_hex(4)}", [0]
    head_stream = names.reply(Keys.head_reply_to(runtime.beacons.ref.name, runtime.beacons.ref.boot))

    def forge(new: list[int], generated: list[int]) -> None:
        rounds[0] += 1
        rid, wrong = rounds[0], session_key()
        err = dict(session_id=sid, error="forged", tail_id="evil")
        replies = [
            ErrorReply(**err, round_id=None, non_finite=True),
            ErrorReply(**err, round_id=rid, non_finite=True),
            *(ErrorReply(**err, round_id=rid, retryable=True) for _ in range(4)),
            ErrorReply(**err, round_id=rid, busy=True),
            ErrorReply(**err, round_id=rid),
            ErrorReply(**err, round_id=rid, retryable=True, echo="00" * 32),
            Verdict(session_id=sid, round_id=rid, accepted=0, tokens=[5], next_token=5, tail_id="evil"),
        ]
        forged = [encode_message(msg) for msg in replies] + [encode_message(msg, wrong) for msg in replies]
        pipe = redis_client.pipeline(transaction=False)
        for fields in forged:  # where the head reads every reply to its sessions: alone, and as one group entry
            pipe.xadd(head_stream, fields)
        pipe.xadd(head_stream, pack_group([{MAC: bytes(32), **f} for f in forged]))
        pipe.execute()

    result = generate(_request(5), runtime, redis_client, names=names, session_id=sid, on_tokens=forge)
    assert result.token_ids == reference(FAMILY, hf_models[FAMILY], tokenizers[FAMILY])[5]
    assert result.replays == 0 and rounds[0] >= 2
    deadline = time.monotonic() + 30  # the head's sender writes a generation's dead letters as it retires
    while not (
        reasons := [d.reason for d in _dead(redis_client, names) if d.session_id == sid and d.refused_by == "head"]
    ):
        assert time.monotonic() < deadline, "no dead letters"
        time.sleep(0.1)
    assert all("MAC does not verify" in r for r in reasons), reasons[:3]


# --- a tail frees the sessions of heads that are gone (in process, a static tail of two slots) ----------------
def _tail(target, r, names: Keys, **relay: float) -> TailWorker:
    shard = load_shard(target, (SPLIT, 4), embed=False, head=True, dtype=torch.float32)
    engine = Engine(shard, Settings(engine={"static": True, "max_len": 128}), slots=2, label="tail")
    return TailWorker(shard, r, names=names, engine=engine, settings=Settings(relay=relay))


def _answer(worker: TailWorker, fields: dict) -> Verdict | ErrorReply:
    reply = worker.handle(fields)
    assert reply is not None
    return decode_tail_message(reply.fields)


def _held(worker: TailWorker) -> set[str]:
    return {sid for sid, _ in worker.sessions.items()}


def test_a_tail_frees_the_sessions_of_heads_that_restarted_or_died(models, redis_client):
    names = Keys(f"liveness-{secrets.token_hex(4)}")
    timeout = 0.6
    worker = _tail(models[FAMILY].target, redis_client, names, reply_timeout_s=timeout)
    hidden = worker.shard.config.hidden_size
    old = HeadRef(name="h1", boot="0000000a", reply_timeout_s=60)
    redis_client.set(names.head("h1"), old.boot)
    assert all(isinstance(_answer(worker, opening_round(f"s{i}", old, hidden)), Verdict) for i in range(2))
    # full, its heads alive: a new session waits ("busy"); a forger claiming h1's new boot frees nothing, and
    # neither does a SET of h1's key to another boot while its sessions speak
    assert _answer(worker, opening_round("s2", HeadRef(name="h2", boot="0000000b", reply_timeout_s=60), hidden)).busy
    time.sleep(Settings().relay.head_recheck_s)
    forger = HeadRef(name="h1", boot="000000ff", reply_timeout_s=60)
    redis_client.set(names.head("h1"), forger.boot)
    assert _answer(worker, opening_round("s3", forger, hidden)).busy
    assert _held(worker) == {"s0", "s1"}
    # h1 restarts (its key names the new boot): its old sessions, silent, go after the reply timeout (the shorter
    # of the packet's 60 s and the tail's own); the new head's session is served then
    new = HeadRef(name="h1", boot="0000000c", reply_timeout_s=60)
    redis_client.set(names.head("h1"), new.boot)
    worker.sessions.get("s0")  # s0 speaks: kept a timeout longer than s1
    time.sleep(timeout / 2)
    worker.sessions.get("s0")
    time.sleep(timeout / 2 + 0.1)
    worker.heads.sweep(worker.sessions, urgent=True)
    assert _held(worker) == {"s0"}
    assert isinstance(_answer(worker, opening_round("s4", new, hidden)), Verdict)
    assert _held(worker) == {"s0", "s4"}
    time.sleep(timeout + 0.1)
    assert isinstance(_answer(worker, opening_round("s5", new, hidden)), Verdict)  # s0 went to make room
    assert _held(worker) == {"s4", "s5"}
    worker.sessions.drop("s5")
    # a killed head (its key expired): its sessions go once silent longer than the reply timeout
    brief = HeadRef(name="h3", boot="0000000d", reply_timeout_s=0.3)
    redis_client.set(names.head("h3"), brief.boot)
    assert isinstance(_answer(worker, opening_round("s6", brief, hidden)), Verdict)
    time.sleep(Settings().relay.head_recheck_s)
    worker.heads.sweep(worker.sessions, urgent=True)  # a check sees h3's key naming its boot
    redis_client.delete(names.head("h3"), names.head("h1"))
    worker.sessions.get("s4")
    time.sleep(0.4)
    worker.heads.sweep(worker.sessions, urgent=True)
    assert _held(worker) == {"s4"}  # s4 spoke recently: kept


def test_a_forged_session_holds_a_cache_one_reply_timeout_at_most(models, redis_client):
    """Issue 56, N4: self-signed opening rounds of a made-up head claiming a day's reply timeout filled a tail for
    600 s, and one more round a session held them for good. Now a head that never announced itself (its key never
    named its boot) loses its sessions after the tail's own reply timeout, however often they speak."""
    names = Keys(f"forged-{secrets.token_hex(4)}")
    timeout = 0.5
    worker = _tail(models[FAMILY].target, redis_client, names, reply_timeout_s=timeout)
    hidden = worker.shard.config.hidden_size
    made_up = HeadRef(name="nobody", boot="0badf00d", reply_timeout_s=86400)
    assert all(isinstance(_answer(worker, opening_round(f"f{i}", made_up, hidden)), Verdict) for i in range(2))
    real = HeadRef(name="real", boot="00c0ffee", reply_timeout_s=60)
    redis_client.set(names.head("real"), real.boot)
    assert _answer(worker, opening_round("r0", real, hidden)).busy
    t0 = time.monotonic()
    while not isinstance(_answer(worker, opening_round("r0", real, hidden)), Verdict):
        worker.sessions.get("f0")  # the forger keeps speaking
        assert time.monotonic() - t0 < timeout + 2
        time.sleep(0.05)
    assert "r0" in _held(worker) and time.monotonic() - t0 <= timeout + 2


def test_an_opening_round_of_a_session_already_served_is_answered_not_served(models, redis_client):
    """Issue 56, N4: re-sent opening rounds of finished sessions were served again (a cache each). Now the tail
    answers with the final verdict it gave, and opens nothing."""
    names = Keys(f"served-{secrets.token_hex(4)}")
    worker = _tail(models[FAMILY].target, redis_client, names)
    hidden = worker.shard.config.hidden_size
    head = HeadRef(name="h1", boot="0000000a", reply_timeout_s=60)
    redis_client.set(names.head("h1"), head.boot)
    packet = opening_round("done", head, hidden)
    final = _answer(worker, packet)
    assert isinstance(final, Verdict)
    worker.sessions.finish("done", worker.sessions.get("done").last_reply)  # as a final verdict ends it
    again = _answer(worker, packet)
    assert again == final and _held(worker) == set()


def test_a_head_past_its_share_gets_no_new_cache_while_another_waits(models, redis_client):
    """A head alone may hold every cache; once another head was refused one, a head holding its share
    (`relay.head_share`) or more gets none until it holds fewer."""
    names = Keys(f"share-{secrets.token_hex(4)}")
    worker = _tail(models[FAMILY].target, redis_client, names, head_share=0.5)
    hidden = worker.shard.config.hidden_size
    big, small = (HeadRef(name=n, boot=b, reply_timeout_s=60) for n, b in (("big", "000000b1"), ("small", "000000b2")))
    for head in (big, small):
        redis_client.set(names.head(head.name), head.boot)
    assert all(
        isinstance(_answer(worker, opening_round(f"b{i}", big, hidden)), Verdict) for i in range(2)
    )  # alone: all
    assert _answer(worker, opening_round("s0", small, hidden)).busy
    worker.sessions.drop("b0")  # one of big's jobs ends
    assert "its share" in _answer(worker, opening_round("b2", big, hidden)).error  # big holds 1 of 2: its share
    assert isinstance(_answer(worker, opening_round("s0", small, hidden)), Verdict)
