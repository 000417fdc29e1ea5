"""Fuzzing the relay: over a thousand malformed, truncated, oversized, wrong-version, out-of-vocabulary
and duplicated packets written into a tail's streams while real generations run. The tail survives,
the real generations still equal HF generate, and every bad packet is dead-lettered with its reason."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import torch
from click.testing import CliRunner

from producer.cli import main
from relay_broker.streams import publish
from schemas.packets import HEADER, DeadLetterRecord, encode_round
from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from tests.conftest import PROMPTS
from tests.test_parity import NEW, head_for, reference
from workers.head import generate

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
    return encode_round(header, {"hidden": torch.randn(n, hidden_size)})[1]


def bad_packets(rnd: random.Random, hidden_size: int, vocab: int) -> tuple[list[dict], list[dict], Counter]:
    """(packets to send, good packets among them, expected dead letters by kind)."""
    out: list[dict] = []
    good: list[dict] = []
    kinds: Counter = Counter()

    def add(kind: str, fields: dict) -> None:
        out.append(fields)
        kinds[kind] += 1

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
            head["v"] = 2
            add("wrong version", {**fields, HEADER: json.dumps(head).encode()})
        elif pick == 3:
            fields = valid_round(sid, hidden_size)
            raw = next(k for k in fields if k != HEADER)
            add("truncated", {**fields, raw: fields[raw][: rnd.randrange(len(fields[raw]))]})
        elif pick == 4:
            fields = valid_round(sid, hidden_size)
            head = json.loads(fields[HEADER])
            head["tensors"]["hidden"]["shape"] = [1 << 20, hidden_size]
            add("oversized tensor", {**fields, HEADER: json.dumps(head).encode()})
        elif pick == 5 and i < 40:
            add("oversized header", {HEADER: b"{" + b" " * (1 << 20) + b"}"})
        elif pick == 6:
            fields = valid_round(sid, hidden_size)
            head = json.loads(fields[HEADER])
            head["input_ids"] = [vocab + 7]
            head["tensors"]["hidden"]["shape"] = [1, hidden_size]
            raw = next(k for k in fields if k != HEADER)
            add("out of vocabulary", {HEADER: json.dumps(head).encode(), raw: fields[raw][: 4 * hidden_size]})
        elif pick == 7:
            fields = valid_round(sid, hidden_size)
            head = json.loads(fields[HEADER])
            head["round_id"] = -3
            add("invalid field", {**fields, HEADER: json.dumps(head).encode()})
        elif pick == 8:
            fields = valid_round(sid, hidden_size)
            add("extra field", {**fields, b"t.evil": b"\x00" * 8})
        elif pick == 9 and i % 3 == 0:  # a real (fake-session) round, then the same packet twice more
            fields = valid_round(sid, hidden_size)
            out.append(fields)
            good.append(fields)
            add("duplicate", fields)
            add("duplicate", fields)
        else:
            add("garbage", {HEADER: b'{"v": 1, "kind": "round", "session_id": "' + sid.encode() + b'"'})
    return out, good, kinds


def test_fuzzed_streams_dead_letter_everything_and_real_generations_finish(
    models, hf_models, tokenizers, tails, redis_client, redis_server
):
    ms = models[FAMILY]
    names = tails.get(ms.target, SPLIT, ms.n_layers, ("--name", "fuzzed"))
    runtime = head_for(ms, SPLIT, ms.drafter)
    cfg = runtime.shard.config
    packets, good, kinds = bad_packets(random.Random(7), cfg.hidden_size, cfg.vocab_size)
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
        publish(redis_client, names.shared_requests if i % 2 else own, fields)
    for t in threads:
        t.join(120)
    assert results == expected  # the real generations, interleaved with the fuzz, are exact

    want = sum(kinds.values())
    deadline = time.monotonic() + 120
    while redis_client.xlen(names.dead_letters) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    records = [DeadLetterRecord.model_validate_json(f[HEADER]) for _, f in redis_client.xrange(names.dead_letters)]
    assert len(records) == want, Counter(r.reason.split(":")[0] for r in records)
    assert all(r.reason and r.tail_id == "fuzzed" for r in records)
    assert sum("duplicate or late round" in r.reason for r in records) == kinds["duplicate"]
    assert sum("version" in r.reason for r in records) >= kinds["wrong version"]
    # the tail is still serving: one more real generation
    req = GenerationRequest(prompt=PROMPTS[7], max_new_tokens=NEW, chat_template=False)
    assert generate_with(req) == reference(FAMILY, hf_models[FAMILY], tokenizers[FAMILY])[7]
    listed = CliRunner().invoke(
        main, ["dead-letters", "--count", "5", "--redis-url", redis_server.url, "--prefix", names.prefix]
    )
    assert listed.exit_code == 0 and f"{want} dead letter(s)" in listed.output
    assert len([line for line in listed.output.splitlines() if "tail fuzzed" in line]) == 5
