"""Fuzzing the relay: over a thousand malformed, truncated, oversized, wrong-version, out-of-vocabulary
and duplicated packets written into a tail's streams while real generations run. The tail survives,
the real generations still equal HF generate, and every bad packet is dead-lettered with its reason.
The same for junk written into live sessions' reply streams: heads refuse it and finish exactly."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import torch
from click.testing import CliRunner

from producer.cli import main
from schemas.dead_letters import DeadLetterRecord
from schemas.keys import Keys
from schemas.packets import HEADER, MAC, PROTOCOL_VERSION, Verdict, encode_message
from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from schemas.settings import Settings
from tests.conftest import PROMPTS
from tests.relay_util import TEST_HEAD, announce, reseal, sealed_round
from tests.test_parity import NEW, head_for, reference
from workers.head.runtime import generate

FAMILY, SPLIT = "qwen2", 2


def valid_round(sid: str, hidden_size: int, n: int = 3) -> dict:
    header = dict(
        session_id=sid,
        round_id=0,
        start_pos=0,
        input_ids=list(range(5, 5 + n)),
        draft_ids=[],
        sampling=SamplingParams(),
        eos_token_ids=[0],
        max_new=4,
        q_kind="none",
    )
    return sealed_round(header, {"hidden": torch.randn(n, hidden_size)})


def bad_packets(
    rnd: random.Random, hidden_size: int, vocab: int, kind_of: dict[str, str] | None = None
) -> tuple[list[dict], list[dict], Counter]:
    """(packets to send, good packets among them, expected dead letters by kind); kind_of gets each fake
    session's kind (a failure then says which kinds went missing)."""
    out: list[dict] = []
    good: list[dict] = []
    kinds: Counter = Counter()
    sid = ""

    def add(kind: str, fields: dict) -> None:
        out.append(fields)
        kinds[kind] += 1
        if kind_of is not None:
            kind_of[sid] = kind

    for i in range(1100):
        sid = f"fuzz{i:05d}"
        pick = i % 11
        if pick == 0:
            add("garbage", {HEADER: bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 200)))})
        elif pick == 1:
            add("no header", {b"x": b"1"})
        elif pick == 2:
            fields = valid_round(sid, hidden_size)
            head = json.loads(fields[HEADER])
            head["v"] = 1
            add("wrong version", reseal({**fields, HEADER: json.dumps(head).encode()}))
        elif pick == 3:
            fields = valid_round(sid, hidden_size)
            raw = next(k for k in fields if k not in (HEADER, MAC))
            add("truncated", reseal({**fields, raw: fields[raw][: rnd.randrange(len(fields[raw]))]}))
        elif pick == 4:
            fields = valid_round(sid, hidden_size)
            head = json.loads(fields[HEADER])
            head["tensors"]["hidden"]["shape"] = [1 << 20, hidden_size]
            add("oversized tensor", reseal({**fields, HEADER: json.dumps(head).encode()}))
        elif pick == 5 and i < 40:
            add("oversized header", {HEADER: b"{" + b" " * (1 << 20) + b"}"})
        elif pick == 6:
            fields = valid_round(sid, hidden_size)
            head = json.loads(fields[HEADER])
            head["input_ids"] = [vocab + 7]
            head["tensors"]["hidden"]["shape"] = [1, hidden_size]
            raw = next(k for k in fields if k not in (HEADER, MAC))
            add("out of vocabulary", reseal({HEADER: json.dumps(head).encode(), raw: fields[raw][: 4 * hidden_size]}))
        elif pick == 7:
            fields = valid_round(sid, hidden_size)
            head = json.loads(fields[HEADER])
            head["round_id"] = -3
            add("invalid field", reseal({**fields, HEADER: json.dumps(head).encode()}))
        elif pick == 8:
            fields = valid_round(sid, hidden_size)
            add("extra field", {**fields, b"t.evil": b"\x00" * 8})
        elif pick == 9 and i % 3 == 0:  # a real (fake-session) round, then the same packet twice more
            fields = valid_round(sid, hidden_size)
            out.append(fields)
            good.append(fields)
            add("duplicate", fields)
            add("duplicate", fields)
        elif pick == 9:  # a round changed by someone without the session's key
            fields = valid_round(sid, hidden_size)
            head = json.loads(fields[HEADER])
            head["input_ids"][0] += 1
            add("forged", {**fields, HEADER: json.dumps(head).encode()})
        else:
            add("garbage", {HEADER: b'{"v": 1, "kind": "round", "session_id": "' + sid.encode() + b'"'})
    return out, good, kinds


def test_fuzzed_streams_dead_letter_everything_and_real_generations_finish(
    models, hf_models, tokenizers, tails, redis_client, redis_server
):
    ms = models[FAMILY]
    # room for every fake session the fuzz opens (about 34) beside the real ones: a full tail answers "busy"
    # every refusal is counted here: the tail's cap on dead letters a second is lifted
    lifted = (("SHARDFLOW_RELAY__DEAD_LETTER_BURST", "1000000"),)
    names = tails.get(ms.target, SPLIT, ms.n_layers, ("--name", "fuzzed", "--slots", "64"), env=lifted)
    runtime = head_for(ms, SPLIT, ms.drafter)
    cfg = runtime.shard.config
    announce(redis_client, names, TEST_HEAD)  # the fake sessions' head is alive: the tail keeps its sessions
    kind_of: dict[str, str] = {}
    packets, good, kinds = bad_packets(random.Random(7), cfg.hidden_size, cfg.vocab_size, kind_of)
    assert sum(kinds.values()) >= 1000 and good  # good: fake sessions' first rounds, answered normally
    own = names.tail_requests("fuzzed")
    expected = reference(FAMILY, hf_models[FAMILY], tokenizers[FAMILY])[:6]
    results: list = [None] * 6

    def generate_with(req: GenerationRequest) -> list[int]:
        return generate(req, runtime, redis_client, names=names).token_ids

    def real(i: int) -> None:
        req = GenerationRequest(prompt=PROMPTS[i], max_new_tokens=NEW, chat_template=False, draft=DraftSettings(k=4))
        results[i] = generate_with(req)

    threads = [threading.Thread(target=real, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for i, fields in enumerate(packets):
        redis_client.xadd(names.shared_requests if i % 2 else own, fields, maxlen=10_000, approximate=True)
    for t in threads:
        t.join(120)
    assert results == expected  # the real generations, interleaved with the fuzz, are exact

    want = sum(kinds.values())
    deadline = time.monotonic() + 120
    while redis_client.xlen(names.dead_letters) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    records = [DeadLetterRecord.model_validate_json(f[HEADER]) for _, f in redis_client.xrange(names.dead_letters)]
    seen = Counter(kind_of.get(r.session_id or "", "no session") for r in records)
    assert len(records) == want, {k: (seen[k], n) for k, n in kinds.items() if seen[k] != n}
    assert all(r.reason and r.tail_id == "fuzzed" for r in records)
    # a duplicate of a round whose verdict ended its session (its random rows' token was EOS) is "already served"
    again = ("duplicate or late round", "a session already served here")
    assert sum(any(w in r.reason for w in again) for r in records) == kinds["duplicate"]
    assert sum("version" in r.reason for r in records) >= kinds["wrong version"]
    assert sum("MAC" in r.reason for r in records) == kinds["forged"]
    # the tail is still serving: one more real generation
    req = GenerationRequest(prompt=PROMPTS[7], max_new_tokens=NEW, chat_template=False)
    assert generate_with(req) == reference(FAMILY, hf_models[FAMILY], tokenizers[FAMILY])[7]
    listed = CliRunner().invoke(
        main, ["dead-letters", "--count", "5", "--redis-url", redis_server.url, "--prefix", names.prefix]
    )
    assert listed.exit_code == 0 and f"{want} dead letter(s)" in listed.output
    assert len([line for line in listed.output.splitlines() if "tail fuzzed" in line]) == 5


def junk_replies(sid: str, vocab: int) -> list[dict]:
    """Entries that are no reply to the round a head waits for: junk, another session's, a round not sent,
    verdicts that contradict any drafts (far more accepted than drafted, ids beyond the vocabulary)."""
    forged = [
        Verdict(session_id="someone-else", round_id=0, accepted=0, tokens=[5], next_token=5),
        Verdict(session_id=sid, round_id=1 << 30, accepted=0, tokens=[5], next_token=5),
    ]
    for r in range(24):
        forged.append(Verdict(session_id=sid, round_id=r, accepted=60, tokens=[5] * 61, next_token=5))
        forged.append(Verdict(session_id=sid, round_id=r, accepted=0, tokens=[vocab + 3], next_token=vocab + 3))
    return [
        {b"x": b"1"},
        {HEADER: b"\xff\x00 not json"},
        {HEADER: b'{"v": %d, "kind": "verdict"}' % PROTOCOL_VERSION},
        {HEADER: b'{"v": %d, "kind": "verdict"}' % PROTOCOL_VERSION},
        {HEADER: b'{"v": 1, "kind": "verdict", "session_id": "' + sid.encode() + b'"}'},
        {HEADER: b"[]", b"t.x": b"\x00" * 64},
        {HEADER: b"[" * 100_000},  # deeper than the JSON parser's recursion limit
        *(encode_message(v) for v in forged),
    ]


def test_junk_in_live_reply_streams_never_fails_a_generation(models, hf_models, tokenizers, tails, redis_client):
    """Anyone who can write a head's reply stream (a tail, any client of a Redis without ACLs) floods it
    with junk while the generation runs: the head dead-letters what is no reply to its round, keeps waiting
    for the real verdict, and the output equals HF generate."""
    ms = models[FAMILY]
    names = tails.get(ms.target, SPLIT, ms.n_layers, ("--name", "poisoned"))
    runtime = head_for(ms, SPLIT, ms.drafter)
    expected = reference(FAMILY, hf_models[FAMILY], tokenizers[FAMILY])[8:11]
    results: list = [None] * 3
    done = threading.Event()

    def real(i: int) -> None:
        prompt, k4 = PROMPTS[8 + i], DraftSettings(k=4)
        req = GenerationRequest(prompt=prompt, max_new_tokens=NEW, chat_template=False, draft=k4)
        results[i] = generate(req, runtime, redis_client, names=names, session_id=f"poisoned{i}").token_ids

    head_stream = names.reply(Keys.head_reply_to(runtime.beacons.ref.name, runtime.beacons.ref.boot))
    cap = runtime.loop_for(redis_client).dead_cap  # this test reads every refusal: the flood cap is lifted here
    cap.rate = cap.burst = 10**9

    def poison() -> None:
        junk = {f"poisoned{i}": junk_replies(f"poisoned{i}", runtime.shard.config.vocab_size) for i in range(3)}
        while not done.is_set():
            pipe = redis_client.pipeline(transaction=False)
            for entries in junk.values():
                for fields in entries:
                    pipe.xadd(head_stream, fields)
            pipe.execute()
            time.sleep(0.01)

    poisoner = threading.Thread(target=poison)
    poisoner.start()
    threads = [threading.Thread(target=real, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    poisoner.join(10)
    assert results == expected

    def head_refused() -> tuple[list[DeadLetterRecord], Counter]:
        records = [DeadLetterRecord.model_validate_json(f[HEADER]) for _, f in redis_client.xrange(names.dead_letters)]
        return records, Counter(r.session_id for r in records if r.refused_by == "head" and r.session_id is not None)

    deadline = time.monotonic() + 30  # a retired generation's dead letters go with the head's sender, after it
    while len((got := head_refused())[1]) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    records, refused = got
    assert set(refused) == {"poisoned0", "poisoned1", "poisoned2"}  # junk naming no session: session None
    assert max(refused.values()) <= Settings().relay.reply_dead_letters_max  # a flood is counted, not all stored
    reasons = " ".join(r.reason for r in records if r.refused_by == "head")
    for why in ("no header", "not JSON", "nested too deeply", "version", "invalid packet", "MAC does not verify"):
        assert why in reasons, why
