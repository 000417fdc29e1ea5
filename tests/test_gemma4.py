"""Gemma 4's text layers (workers/engine/per_layer.py), built from transformers' own Gemma4TextConfig
(workers/tiny_models.py GEMMA4): per-layer inputs each shard computes from the token ids, the last two layers reading
the keys and values of layers 3 (sliding) and 2 (full), wider full-attention heads with keys as values, double-wide
MLPs, a window shorter than the prompts, the final soft cap; and a mixture-of-experts variant. Shards' logits equal
the model's at every split that keeps each shared layer beside its source, through prompts, rounds and a rejected
draft's rollback; the other splits are refused at load and by the plan, naming the layer; static pools (each layer's
own width, nothing for a shared layer) batch sequences as a growing cache runs each alone; a split generation with a
real tail process equals HF `generate`."""

from __future__ import annotations

import itertools
import secrets
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from schemas.errors import InvalidRequest, ModelLoadError
from schemas.keys import Keys
from schemas.packets import ErrorReply, Verdict, decode_tail_message
from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from schemas.settings import EngineSettings, Settings
from tests.conftest import PROMPTS
from tests.relay_util import announce, sealed_round
from workers.engine.kvcache import KVCache, KVPool, StaticKVCache
from workers.engine.per_layer import kv_sources, widest_mlp
from workers.engine.plan import GiB, kv_bytes, model_shape, plan_split, shard_weights
from workers.engine.runner import Engine
from workers.engine.shard import load_shard
from workers.engine.sizing import cache_modes
from workers.head.runtime import HeadRuntime, generate
from workers.tail.server import TailWorker
from workers.tiny_models import GEMMA4, save_tiny_model, save_tiny_wrapper, tiny_config

NEW = 16
LONG = PROMPTS[16]  # 18 words: longer than the window of 8
SLIDING, FULL = "sliding_attention", "full_attention"
MOE = {**GEMMA4, "layers": 4, "layer_types": [SLIDING, FULL] * 2, "num_kv_shared_layers": 1}  # layer 3 reads layer 1's
MOE |= {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
MOE |= {"hidden_size_per_layer_input": 0}  # no per-layer inputs (as the larger Gemma 4s): a tail needs no ids
MODELS = {"gemma4": (GEMMA4, (1, 2)), "gemma4_moe": (MOE, (1,))}  # config, the splits that keep shared layers whole


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory, tokenizers):
    root, tok = tmp_path_factory.mktemp("gemma4"), tokenizers["qwen2"]
    made = {name: save_tiny_model(root / name, "gemma4_text", tokenizer=tok, **kw) for name, (kw, _) in MODELS.items()}
    return made | {"wrapper": save_tiny_wrapper(root / "wrapper", "gemma4", tokenizer=tok)}


def _hf(target):
    auto = AutoModelForImageTextToText if "wrapper" in str(target) else AutoModelForCausalLM
    return auto.from_pretrained(target, dtype=torch.float32, attn_implementation="eager").eval()


def _bytes(shard) -> int:
    return sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in shard.parameters()}.values())


@pytest.mark.parametrize("name", list(MODELS))
def test_shards_logits_equal_the_models_at_every_legal_split(name, gemma4, tokenizers):
    """A whole shard, then head + tail at each legal split: a prompt, a round of 4 whose last 2 are rejected (both
    caches cropped), and the rest; the tail embeds the ids it is given. Each loads only its part: its layers'
    slices of the per-layer weights, the tail's embedding its tied LM head (what the plan counts). The mixture of
    experts' variant has no per-layer inputs: its tail takes no ids."""
    target, tok = gemma4[name], tokenizers["qwen2"]
    ids = torch.tensor(tok.encode(LONG))
    n = AutoConfig.from_pretrained(target).num_hidden_layers
    shape = model_shape(AutoConfig.from_pretrained(target), torch.float32)
    assert ids.shape[0] > 2 * GEMMA4["sliding_window"]  # type: ignore[operator]
    with torch.inference_mode():
        want = _hf(target)(ids[None]).logits[0]
        whole = load_shard(target, None, embed=True, head=True)
        torch.testing.assert_close(whole.forward(ids, 0, KVCache(), logits_last=len(ids)), want, rtol=1e-4, atol=1e-4)
        for split in MODELS[name][1]:
            head = load_shard(target, (0, split), embed=True, head=False)
            tail = load_shard(target, (split, n), embed=False, head=True)
            assert _bytes(head) == shard_weights(shape, (0, split), embed=True, head=False)
            assert _bytes(tail) == shard_weights(shape, (split, n), embed=False, head=True)
            per_layer = tail.layer_inputs.per_layer  # the tail's embedding: its tied LM head's weight
            assert tail.needs_ids == (per_layer is not None) and not head.needs_ids
            assert per_layer is None or per_layer.tokens.weight is tail.lm_head.weight
            caches, parts, at = (KVCache(), KVCache()), [], 0
            for size, keep in ((ids.shape[0] - 12, None), (4, 2), (10, None)):
                h = head.forward(ids[at : at + size], at, caches[0])
                got = tail.forward(h, at, caches[1], logits_last=size, ids=ids[at : at + size])
                at += size if keep is None else keep
                parts.append(got[:keep])
                for c in caches:
                    c.crop(at)
            torch.testing.assert_close(torch.cat(parts), want, rtol=1e-4, atol=1e-4, msg=f"{name} split {split}")
            shared = kv_sources(AutoConfig.from_pretrained(target))  # their keys live once, in their sources' caches
            assert sorted(caches[1].keys) == [i for i in range(split, n) if i not in shared] and shared


def test_the_multimodal_wrappers_text_shards_equal_its_forward(gemma4, tokenizers):
    """Gemma4ForConditionalGeneration: its text layers and per-layer weights read under the wrapper's names
    (`model.language_model.`), the vision tower never; split 2/4 equals the wrapper's own forward on text."""
    target, tok = gemma4["wrapper"], tokenizers["qwen2"]
    ids = torch.tensor(tok.encode(LONG))
    with torch.inference_mode():
        want = _hf(target)(input_ids=ids[None]).logits[0]
        head = load_shard(target, (0, 2), embed=True, head=False)
        tail = load_shard(target, (2, 6), embed=False, head=True)
        got = tail.forward(head.forward(ids, 0, KVCache()), 0, KVCache(), logits_last=len(ids), ids=ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    names = [n for n, _ in head.named_parameters()] + [n for n, _ in tail.named_parameters()]
    assert not any("vision" in n or "embed_vision" in n for n in names)


def test_a_split_that_parts_a_shared_layer_is_refused_and_the_plan_avoids_it(gemma4):
    """Layers 4 and 5 read the keys and values of layers 3 and 2: a cut at 3, 4 or 5 parts a pair; both sides of
    such a split refuse to load, naming the layer, and the plan picks a cut that keeps them (or refuses one named)."""
    target = gemma4["gemma4"]
    config = AutoConfig.from_pretrained(target)
    for split, (i, j) in ((3, (5, 2)), (4, (4, 3)), (5, (5, 2))):
        line = rf"gemma4_text: layer {i} attends over the keys and values layer {j} computes .* at layer 1, 2\)$"
        with pytest.raises(ModelLoadError, match=line):
            load_shard(target, (split, 6), embed=False, head=True)
        with pytest.raises(ModelLoadError, match=r"layer \d attends over the keys and values layer \d"):
            load_shard(target, (0, split), embed=True, head=False)
    plan = plan_split(config, [GiB, GiB], dtype=torch.float32, settings=Settings(engine={"cuda_context_gib": 0}))
    assert plan.workers[0].layers[1] in (1, 2) and plan.in_flight > 0
    with pytest.raises(ModelLoadError, match=r"layer 4 attends over the keys and values layer 3"):
        plan_split(config, [GiB, GiB], dtype=torch.float32, split=4)
    shape = model_shape(config, torch.float32)  # shared layers cache nothing; full layers 1 head of 32 (keys, values)
    assert shape.kv_layer == (256, 256, 256, 256, 0, 0) and shape.window_layer == (8, 8, None, 8, 8, None)
    assert shape.head_dim == 32 and widest_mlp(config) == 2 * config.intermediate_size  # full heads; double-wide MLPs
    assert kv_bytes(shape, (2, 6), 100, 0) == 2 * 256 * 112  # 100 positions held as 112, a multiple of 16


def test_gemma4_shards_run_static_caches_graphs_float32_moe_only_where_asked_and_refuse_float16(gemma4):
    """Static caches by default, as every family: a pool of each layer's own width and heads, none for a shared
    layer (the tail 2:6 caches layers 2 and 3: full attention 1 head of 32, sliding 2 heads of 16); on a CUDA device,
    CUDA graphs by default, the mixture-of-experts variant's in float32 only where asked."""
    target = gemma4["gemma4"]
    shard = load_shard(target, (2, 6), embed=False, head=True)
    assert shard.graphs_reason is None
    dense_on_cuda = SimpleNamespace(device=torch.device("cuda"), graphs_reason=None)
    assert cache_modes(dense_on_cuda, EngineSettings()) == (True, True)
    moe = load_shard(gemma4["gemma4_moe"], (0, 1), embed=True, head=False)
    on_cuda = SimpleNamespace(device=torch.device("cuda"), graphs_reason=moe.graphs_reason)
    assert moe.graphs_reason.startswith("gemma4_text's mixture-of-experts layers in float32 run CUDA graphs only where")
    assert cache_modes(on_cuda, EngineSettings()) == (True, False)
    assert cache_modes(on_cuda, EngineSettings(graphs=True)) == (True, True)
    moe_bf16 = load_shard(gemma4["gemma4_moe"], (0, 1), embed=True, head=False, dtype=torch.bfloat16)
    assert moe_bf16.graphs_reason is None  # its experts' grouped products capture in bfloat16 (run 121)
    engine = Engine(shard, Settings(engine={"max_len": 256}), slots=2)
    assert isinstance(engine.acquire(), StaticKVCache) and set(engine.pool.keys) == {2, 3}
    assert engine.pool.keys[2].shape[1::2] == (1, 32) and engine.pool.values[3].shape[1::2] == (2, 16)
    assert Engine(shard, Settings(engine={"static": False})).acquire().__class__ is KVCache
    shape = model_shape(AutoConfig.from_pretrained(target), torch.float32)  # the plan counts the pool as it is held
    for (positions, scratch), slack in itertools.product([(256, 16), (250, 9)], (None, 80)):
        pool = KVPool.for_shard(shard, slots=1, max_len=positions, scratch=scratch, ring_slack=slack)
        held = sum(t[0].nbytes for t in (*pool.keys.values(), *pool.values.values()))  # a slot, as allocated
        assert kv_bytes(shape, (2, 6), positions, scratch, slack) == held
        assert held == KVPool.slot_bytes(shard, positions, scratch, slack)
    with pytest.raises(ModelLoadError, match="gemma4_text overflows float16"):
        load_shard(target, (0, 2), embed=True, head=False, dtype=torch.float16)
    with pytest.raises(ValueError, match="pass the token ids"), torch.inference_mode():
        shard.forward(torch.zeros(3, 64), 0, KVCache(), logits_last=1)
    with pytest.raises(ValueError, match="pass the token ids"), torch.inference_mode():  # a batch on the pool too
        engine.forward_many([engine.acquire()], [torch.zeros(3, 64)], [0], 1)


def test_a_tail_batchs_graph_is_given_its_rows_ids_padded_as_they_are(gemma4, monkeypatch):
    """Where graphs run (asked for on a CUDA device), a tail's batch hands its graph the rows' ids, padded to the
    graph's step as the hidden rows are (a graph's replay copies them into its own buffer: `BatchGraph.ids`)."""
    shard = load_shard(gemma4["gemma4"], (2, 6), embed=False, head=True)
    engine = Engine(shard, Settings(engine={"max_len": 256, "graph_k": 3}), slots=4)
    seen: list[torch.Tensor | None] = []

    def graph(pool, b, t, p, steps=0, length=None, log_it=True):
        def replay(rows, x, pos, pick, ids=None):
            seen.append(ids)
            return torch.zeros(rows.shape[0], t, shard.config.hidden_size)

        return replay

    monkeypatch.setattr(engine, "graphs", True)
    monkeypatch.setattr(engine, "_graph", graph)
    caches, ids = [engine.acquire(), engine.acquire()], [torch.tensor([5, 6]), torch.tensor([7, 8, 9])]
    engine.forward_many(caches, [torch.zeros(2, 64), torch.zeros(3, 64)], [0, 0], 0, ids=ids)
    assert seen[0].tolist() == [[5, 6, 0, 0], [7, 8, 9, 0]]  # padded to the graph's 4 tokens a row


@pytest.mark.parametrize(
    ("name", "slack", "dev"),
    [("gemma4", None, "cpu"), ("gemma4", 64, "cpu"), ("gemma4_moe", 64, "cpu")]
    # with CUDA (collected only there: CI skips nothing), graphs: passed on an H100 (run 116); the MoE variant's
    # experts (torch._grouped_mm) copy a host tensor while captured in float32 there (in bfloat16 they capture and
    # equal eager rounds exactly: run 121, a throwaway check not kept)
    + [pytest.param("gemma4", 64, "cuda", id="gemma4-graphs")] * torch.cuda.is_available(),
)
def test_static_batches_equal_each_sequence_on_a_growing_cache(name, slack, dev, gemma4):
    """Three sequences batched over static pools, head (0:s) and tail (s:n, given each row's ids) and the whole
    model drafting: prompts of 20-110 tokens (past the window of 8 and, with a slack of 64, past the sliding layers'
    rings of 80), then 30 rounds of 1-4 tokens each rolled back to a random prefix, then a whole draft of 4; each
    row's logits equal the whole model's on a growing cache of its own, and its drafts are that model's greedy. On a
    CUDA device (bench/device.sh gemma4) the rounds and drafts replay CUDA graphs, a tail's taking its rows' ids."""
    (_, (split, *_)), target = MODELS[name], gemma4[name]
    graphs, tol = ({"graphs": True}, 1e-3) if dev == "cuda" else ({}, 1e-4)  # float32; other kernels on CUDA
    settings = Settings(engine={"static": True, "max_len": 256, "window_slack": slack, "graph_k": 3} | graphs)
    gen = torch.Generator().manual_seed(0)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=gen))  # noqa: E731
    with torch.inference_mode():
        whole = load_shard(target, None, embed=True, head=True, device=dev)
        n, vocab = whole.config.num_hidden_layers, whole.config.vocab_size
        head = load_shard(target, (0, split), embed=True, head=False, device=dev)
        tail = load_shard(target, (split, n), embed=False, head=True, device=dev)
        engines = [Engine(shard, settings, slots=4) for shard in (head, tail)] + [
            Engine(whole, settings, slots=4, max_draft=4)
        ]
        assert (slack is not None) == bool(engines[1].pool.rings or engines[0].pool.rings)
        caches = [[e.acquire(need=256) for _ in range(3)] for e in engines]
        mine = [KVCache() for _ in range(3)]
        assert all(e.graphs == (dev == "cuda") for e in engines)
        lens, steps = [0] * 3, [torch.randint(0, vocab, (m,), generator=gen).to(dev) for m in (20, 64, 110)]
        for _ in range(31):
            hidden = engines[0].forward_many(caches[0], steps, lens)
            wants = [s.shape[0] for s in steps]
            got = engines[1].forward_many(caches[1], hidden, lens, wants, ids=steps)
            alone = engines[2].forward_many(caches[2], steps, lens, wants)
            for b, (step, at) in enumerate(zip(steps, lens, strict=True)):
                want = whole.forward(step, at, mine[b], logits_last=step.shape[0])
                torch.testing.assert_close(got[b], want, rtol=tol, atol=tol)
                torch.testing.assert_close(alone[b], want, rtol=tol, atol=tol)
            lens = [at + rand(1, s.shape[0]) for at, s in zip(lens, steps, strict=True)]  # the prefix kept
            for cache, keep in ((c, at) for row in (*caches, mine) for c, at in zip(row, lens, strict=True)):
                cache.crop(keep)
            steps = [torch.randint(0, vocab, (rand(1, 4),), generator=gen).to(dev) for _ in range(3)]
        feeds = [[rand(0, vocab - 1)] for _ in range(3)]
        drafts = engines[2].draft_many(caches[2], feeds, lens, [4] * 3)
        for b, (feed, at) in enumerate(zip(feeds, lens, strict=True)):
            tokens, x = [], torch.tensor(feed, device=dev)
            for _ in range(4):
                tokens.append(int(whole.forward(x, at, mine[b], logits_last=1)[-1].argmax()))
                at, x = at + x.shape[0], torch.tensor(tokens[-1:], device=dev)
            assert drafts[b, :4].tolist() == tokens, b


@pytest.mark.parametrize(
    ("name", "static"),
    [("gemma4", True), pytest.param("gemma4", False, marks=pytest.mark.slow)]
    + [pytest.param("wrapper", True, marks=pytest.mark.slow)],
)
def test_split_generation_equals_generate(name, static, gemma4, tokenizers, tails, redis_client):
    """Greedy, model drafts (the model itself) and n-gram drafts, split 2/4 through a real tail process (which
    embeds each round's ids for its per-layer inputs), prompts short and longer than the window; on static caches
    (the default) and growing ones."""
    target, tok = gemma4[name], tokenizers["qwen2"]
    hf, names = _hf(target), tails.get(target, 2, 6, () if static else ("--dynamic-cache",))
    runtime = HeadRuntime.load(target, (0, 2), draft=str(target), settings=Settings(engine={"static": static}))
    for prompt in (PROMPTS[1], LONG):
        ids = torch.tensor([tok.encode(prompt)])
        want = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        for kind, k in (("model", 4), ("ngram", 3)):
            req = GenerationRequest(
                prompt=prompt, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(kind=kind, k=k)
            )
            got = generate(req, runtime, redis_client, names=names).token_ids
            assert got == want[0, ids.shape[1] :].tolist(), (prompt, kind)


def test_a_tail_batch_embeds_each_rounds_ids_and_refuses_ids_past_the_per_layer_table(
    tmp_path, tokenizers, redis_client
):
    """Rounds of three sessions read together by a tail of split 2/6 whose per-layer table is shorter than the
    vocabulary: the two whose ids it can embed get the whole model's greedy tokens (each round its own ids, of its
    own hidden rows); the one with an id below the vocabulary but past the table's rows fails alone, before any
    forward, with the reason (unchecked, transformers' lookup would index past the table: on CUDA a device-side
    assert that takes the whole tail down), dead-lettered."""
    tok = tokenizers["qwen2"]
    vocab = len(tok)
    target = save_tiny_model(
        tmp_path / "short", "gemma4_text", tokenizer=tok, **GEMMA4, vocab_size_per_layer_input=vocab - 2
    )
    names = Keys(f"g4-{secrets.token_hex(4)}")
    announce(redis_client, names)
    head = load_shard(target, (0, 2), embed=True, head=False)
    whole = load_shard(target, None, embed=True, head=True)
    worker = TailWorker(load_shard(target, (2, 6), embed=False, head=True), redis_client, names=names)
    prompts = {"a": tok.encode(LONG), "b": tok.encode(PROMPTS[1]), "bad": [5, vocab - 1, 7]}  # 316 in LONG
    opening = dict(round_id=0, start_pos=0, draft_ids=[3, 4], sampling=SamplingParams(), eos_token_ids=[], max_new=8)
    with torch.inference_mode():
        packets = [
            sealed_round(  # the head's hidden rows (its table is as short: it embeds the bad id clamped)
                opening | {"session_id": sid, "input_ids": ids, "q_kind": "none"},
                {"hidden": head.forward(torch.tensor([*ids, 3, 4]).clamp(max=vocab - 3), 0, KVCache())},
            )
            for sid, ids in prompts.items()
        ]
        replies = [decode_tail_message(r.fields) for r in worker.handle_many(packets) if r is not None]
        for sid in ("a", "b"):
            logits = whole.forward(torch.tensor([*prompts[sid], 3, 4]), 0, KVCache(), logits_last=3)
            want, accepted = logits.argmax(-1).tolist(), 0
            while accepted < 2 and want[accepted] == [3, 4][accepted]:
                accepted += 1
            got = next(r for r in replies if r.session_id == sid)
            assert isinstance(got, Verdict) and got.tokens == [3, 4][:accepted] + [want[accepted]], sid
    bad = next(r for r in replies if r.session_id == "bad")
    assert isinstance(bad, ErrorReply) and bad.error == f"token ids must be below the vocabulary size {vocab - 2}"
    assert [d.session_id for d in worker.take_dead_letters()] == ["bad"]


def test_a_shared_layer_without_a_source_of_its_type_is_refused_by_name(tokenizers):
    config = tiny_config("gemma4_text", len(tokenizers["qwen2"]), **GEMMA4 | {"layer_types": [SLIDING] * 5 + [FULL]})
    with pytest.raises(ModelLoadError, match=r"layer 5 shares the keys and values of an earlier full_attention layer"):
        kv_sources(config)


def test_the_head_refuses_a_prompt_id_past_the_per_layer_table(tmp_path, tokenizers):
    """A prompt of token ids is checked against the per-layer table's rows too, where they are fewer than the
    vocabulary's: the request is refused with the reason, before the head's own lookup could index past them."""
    vocab = len(tokenizers["qwen2"])
    short = GEMMA4 | {"vocab_size_per_layer_input": vocab - 2}
    target = save_tiny_model(tmp_path / "short", "gemma4_text", tokenizer=tokenizers["qwen2"], **short)
    runtime = HeadRuntime.load(target, (0, 2))
    ok = GenerationRequest(prompt_ids=[5, vocab - 3], max_new_tokens=2)
    assert runtime.prompt_ids(ok) == [5, vocab - 3]
    with pytest.raises(InvalidRequest, match=f"outside the vocabulary of {vocab - 2}"):
        runtime.prompt_ids(GenerationRequest(prompt_ids=[5, vocab - 1], max_new_tokens=2))
