"""The lean fused layer forward (workers/engine/fused.py) and whole-draft runs (Engine.draft_many) compute what
the Hugging Face layers and token-by-token drafting compute."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from schemas.settings import Settings
from workers.engine import shard as shard_mod
from workers.engine.fused import FusedLayers, fuse_layer, fused_stack, rotate_elementwise, rotate_half_signs, rotation
from workers.engine.kvcache import BatchView, KVCache, KVPool
from workers.engine.runner import BatchGraph, Engine, greedy_steps
from workers.engine.shard import load_shard
from workers.speculative.drafters import ModelDrafter, propose_greedy_many
from workers.tiny_models import save_tiny_model


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@torch.inference_mode()
def test_fused_forward_equals_hf_layers(models, family, monkeypatch):
    path = models[family].target
    fused = load_shard(path, None, embed=True, head=True, fused=True)
    plain = load_shard(path, None, embed=True, head=True, fused=False)
    assert isinstance(fused.fused, FusedLayers) and plain.fused is None
    x = torch.arange(3, 120) % fused.config.vocab_size
    heads = fused.fused.heads
    for static, prompt, budget in ((False, 30, None), (True, 30, None), (False, 100, heads * 64 * 64 * 4)):
        # growing caches, static slots (masked), and a prefill whose scores outgrow the budget (HF layers)
        monkeypatch.setattr(shard_mod, "FUSED_MAX_SCORE_BYTES", budget or shard_mod.FUSED_MAX_SCORE_BYTES)
        if budget:
            assert not fused._fused_fits(torch.empty(1, prompt, 1), [None]) and fused._fused_fits(x[:1, None], [None])
        ef, ep = (
            Engine(fused, Settings(engine={"static": static, "max_len": 128})),
            Engine(plain, Settings(engine={"static": static, "max_len": 128})),
        )
        cf, cp = ef.acquire(), ep.acquire()
        got, want = ef.forward(cf, x[:prompt], 0, prompt), ep.forward(cp, x[:prompt], 0, prompt)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for i in range(prompt, prompt + 7):  # one token at a time, then a rollback and a 3-token step
            got, want = ef.forward(cf, x[i : i + 1], i, 1), ep.forward(cp, x[i : i + 1], i, 1)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        cf.crop(prompt + 3)
        cp.crop(prompt + 3)
        got, want = ef.forward(cf, x[:3], prompt + 3, 3), ep.forward(cp, x[:3], prompt + 3, 3)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


NEWER = {  # families the fused layers run beyond Qwen2 / Llama / Mistral, with a window in some layers or none
    "qwen3": ("qwen3", {}),
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    "gemma3-window": ("gemma3_text", {"sliding_window": 8}),  # 1 + w norms, four a layer, GELU, two rotary bases
    "qwen3_moe": ("qwen3_moe", {"mlp_only_layers": [1]}),  # experts beside a dense layer
    "qwen2_moe": ("qwen2_moe", {}),  # a shared expert, q/k/v biases
    "mixtral": ("mixtral", {}),
    "gpt_oss-window": ("gpt_oss", {"sliding_window": 8}),  # sinks, a window every other layer, half-width rotary, YaRN
}
RANDOMIZED = ("norm", "sinks", "bias")  # parameters a tiny model leaves at 0 or 1: set, each counts


@pytest.mark.parametrize("name", list(NEWER))
@torch.inference_mode()
def test_newer_families_run_fused_and_equal_hf_layers(tmp_path, tokenizers, name, monkeypatch):
    """Qwen3 (per-head q_norm / k_norm), Gemma 3, mixtures of experts and gpt-oss, their layers fused, every norm,
    sink and bias set to its own values (so each counts, and where it goes). Static slots and growing caches, one
    token at a time, a rollback; SDPA forced too (gpt-oss's sinks keep to `attend`)."""
    import workers.engine.fused as fused_mod

    family, extra = NEWER[name]
    path = save_tiny_model(tmp_path / name, family, tokenizer=tokenizers["qwen2"], **extra)
    fused = load_shard(path, None, embed=True, head=True, fused=True)
    plain = load_shard(path, None, embed=True, head=True, fused=False)
    assert isinstance(fused.fused, FusedLayers) and plain.fused is None and fused.windowed == ("window" in name)
    gen = torch.Generator().manual_seed(0)
    for (n, a), (_, b) in zip(fused.layers.named_parameters(), plain.layers.named_parameters(), strict=True):
        if any(k in n for k in RANDOMIZED):
            w = torch.rand(a.shape, generator=gen) + 0.3
            a.copy_(w)
            b.copy_(w)
    fused.fused = fused_stack(fused.layers[0], [fuse_layer(x, False, fused.config) for x in fused.layers], fused.config)
    x = torch.arange(3, 60) % fused.config.vocab_size
    for static, sdpa in ((False, False), (True, False), (True, True)):
        fused.fused.sdpa = sdpa
        monkeypatch.setattr(fused_mod, "SDPA_MIN_ROWS", 0 if sdpa else fused_mod.SDPA_MIN_ROWS)
        settings = Settings(engine={"static": static, "max_len": 128})
        ef, ep = Engine(fused, settings), Engine(plain, settings)
        cf, cp = ef.acquire(), ep.acquire()
        torch.testing.assert_close(ef.forward(cf, x[:30], 0, 30), ep.forward(cp, x[:30], 0, 30), rtol=1e-4, atol=1e-4)
        for i in range(30, 34):
            got, want = ef.forward(cf, x[i : i + 1], i, 1), ep.forward(cp, x[i : i + 1], i, 1)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        cf.crop(32)
        cp.crop(32)
        torch.testing.assert_close(ef.forward(cf, x[:3], 32, 3), ep.forward(cp, x[:3], 32, 3), rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_fused_attention_through_sdpa_equals_hf_layers(models, monkeypatch):
    """The SDPA attention CUDA half batches take (fused.attend_sdpa), forced here on a float32 CPU shard: equal to
    the HF layers as the GEMM attention is, with a mask (static slots, several tokens) and without (one token)."""
    import workers.engine.fused as fused_mod

    path = models["qwen2"].target
    fused = load_shard(path, None, embed=True, head=True, fused=True)
    plain = load_shard(path, None, embed=True, head=True, fused=False)
    fused.fused.sdpa = True
    monkeypatch.setattr(fused_mod, "SDPA_MIN_ROWS", 0)
    x = torch.arange(3, 60) % fused.config.vocab_size
    for static in (False, True):
        settings = Settings(engine={"static": static, "max_len": 128})
        ef, ep = Engine(fused, settings), Engine(plain, settings)
        cf, cp = ef.acquire(), ep.acquire()
        torch.testing.assert_close(ef.forward(cf, x[:30], 0, 30), ep.forward(cp, x[:30], 0, 30), rtol=1e-4, atol=1e-4)
        for i in range(30, 33):
            got, want = ef.forward(cf, x[i : i + 1], i, 1), ep.forward(cp, x[i : i + 1], i, 1)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_rotation_matrix_is_rotate_half():
    cos, sin = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    x = torch.randn(6, 5, 8)  # [positions, heads, d]
    half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    want = x * cos.reshape(6, 1, 8) + half * sin.reshape(6, 1, 8)
    torch.testing.assert_close(torch.matmul(x, rotation(cos, sin, rotate_half_signs(8, x.dtype, x.device))), want)
    torch.testing.assert_close(rotate_elementwise(x, cos.reshape(6, 1, 8), sin.reshape(6, 1, 8)), want)


@torch.inference_mode()
def test_a_forward_builds_its_rotation_once_not_once_a_layer(models, monkeypatch):
    """Layers sharing one cos/sin share one rotation matrix (a 7B round's at 128 sequences: 38 MB, and an add and a
    product over it, a layer each on an H100 in run 120 of docs/runs/journal.md)."""
    from workers.engine import fused as fused_mod

    shard = load_shard(models["qwen2"].target, None, embed=True, head=True, fused=True)
    assert len(shard.fused.layers) > 1
    built = []
    monkeypatch.setattr(fused_mod, "rotation", lambda *a: built.append(1) or rotation(*a))
    engine = Engine(shard, Settings(engine={"static": True, "max_len": 64}))
    engine.forward(engine.acquire(), torch.arange(3, 12), 0, 1)
    assert len(built) == 1


@torch.inference_mode()
def test_whole_drafts_equal_token_by_token(models, tokenizers):
    """draft_many (one graph per draft on CUDA; the same steps eagerly here) against the step loop, for a
    batch with different draft lengths and feeds of one and two tokens, across rollbacks."""
    path = models["qwen2"].drafter
    shard = load_shard(path, None, embed=True, head=True)
    whole = ModelDrafter(
        shard, Engine(shard, Settings(engine={"static": True, "max_len": 128}), step_tokens=2, pad=False, max_draft=6)
    )
    steps = ModelDrafter(shard, Engine(shard, Settings(engine={"static": False})))
    tok = tokenizers["qwen2"]
    contexts = [tok.encode(p) for p in ("The quick brown fox", "Hello world! How are you", "Tokyo")]
    a = [whole.new_session() for _ in contexts]
    used, run = [0], whole.engine.draft_many

    def counted(*args):
        out = run(*args)
        used[0] += out is not None
        return out

    whole.engine.draft_many = counted
    b = [steps.new_session() for _ in contexts]
    ks = [6, 3, 1]
    for round_ in range(4):
        got = propose_greedy_many(a, contexts, ks)
        want = propose_greedy_many(b, contexts, ks)
        assert [d.tokens for d in got] == [d.tokens for d in want]
        assert [s.cache.length for s in a] == [len(c) + k - 1 for c, k in zip(contexts, ks, strict=True)]
        for i, d in enumerate(got):  # accept some drafts, then a correction token (or all + bonus)
            keep = (round_ + i) % (len(d.tokens) + 1)
            contexts[i] = contexts[i] + d.tokens[:keep] + [(d.tokens[keep - 1] + 1) % 300 if keep else 5]
        ks = [ks[-1], *ks[:-1]]
    held = a[0].cache.length
    for k in (7, 0):  # longer than the engine's max_draft, or no draft: not run, nothing changed
        assert whole.engine.draft_many([a[0].cache], [[1]], [held], [k]) is None
        assert a[0].cache.length == held
    assert used[0] >= 3  # every round after the prompts' prefill ran as whole drafts


class _HostCopies(TorchDispatchMode):
    """Records ops a CUDA graph capture refuses: host scalars copied to the device, CPU tensors mixed in."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {a.device.type for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        if "scalar_tensor" in str(func) or ("cpu" in devices and len(devices) > 1):
            self.bad.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "gpt_oss"])
@torch.inference_mode()
def test_batched_forward_and_whole_draft_are_capture_safe(models, tmp_path, tokenizers, family):
    """The fused forward and the whole-draft loop run on the meta device (standing in for CUDA) without
    building host tensors: the CPU suite guards the GPU's graph captures (experts routed on the device too)."""
    tok = tokenizers["qwen2"]
    path = models[family].target if family in models else save_tiny_model(tmp_path, family, tokenizer=tok)
    dtype = torch.float32 if family == "qwen2" else torch.bfloat16  # CUDA's grouped GEMM takes bf16 (sm_80+)
    shard = load_shard(path, None, embed=True, head=True, dtype=dtype).to("meta")
    shard.rotary = shard.rotary.to("meta")
    shard.fused = fused_stack(shard.layers[0], [fuse_layer(x, True, shard.config) for x in shard.layers], shard.config)
    pool = KVPool.for_shard(shard, slots=2, max_len=64, scratch=16)
    rows, pick = torch.zeros(3, dtype=torch.long, device="meta"), torch.zeros(3, 1, dtype=torch.long, device="meta")
    x = pos = torch.zeros(3, 2, dtype=torch.long, device="meta")
    with _HostCopies() as spy:
        shard.run_batch(x, pos, BatchView(pool, rows, pos), pick)
        greedy_steps(shard.run_batch, pool, rows, x, pos, pick, 4)
    assert spy.bad == []


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: `replay` re-runs the captured callable (set by the test)."""

    def replay(self) -> None:
        self.rerun()


@contextlib.contextmanager
def _no_capture(*_, **__):
    yield


@torch.inference_mode()
def test_graph_wrapper_pads_and_replays(models, monkeypatch):
    """BatchGraph's own logic (padding rows, inputs copied in, whole-draft body) on CPU, with capture and
    replay simulated: replaying the recorded callable must give the eager whole-draft result."""
    for name, value in {
        "device": _no_capture,
        "stream": _no_capture,
        "graph": _no_capture,
        "Stream": lambda: SimpleNamespace(wait_stream=lambda *_: None),
        "current_stream": lambda: SimpleNamespace(wait_stream=lambda *_: None),
        "CUDAGraph": _FakeGraph,
        "graph_pool_handle": lambda: (0, 0),
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    shard = load_shard(models["qwen2"].target, None, embed=True, head=True)
    pool = KVPool.for_shard(shard, slots=4, max_len=64, scratch=10)
    ref_pool = KVPool.for_shard(shard, slots=4, max_len=64, scratch=10)
    graph = BatchGraph(shard, shard.run_batch, pool, 4, 2, 1, steps=5)
    graph.graph.rerun = lambda: graph.out.copy_(
        graph.forward(graph.x, graph.pos, BatchView(pool, graph.rows, graph.pos), graph.pick)
    )
    x = torch.tensor([[5, 9], [7, 0]])
    rows, pos, pick = torch.tensor([2, 0]), torch.tensor([[10, 11], [3, 4]]), torch.tensor([[1], [0]])
    got = graph(rows, x, pos, pick)
    want = greedy_steps(shard.run_batch, ref_pool, rows, x, pos, pick, 5)
    assert got.shape == (2, 5)
    assert torch.equal(got, want)


@torch.inference_mode()
def test_bf16_fused_forward_is_as_close_to_float32_as_hf(models):
    """In bf16 the fused forward (float32 attention scores from widened q/k on CPUs) stays as close to the
    float32 model as the HF layers do; roundings differ, so only closeness is checked."""
    path = models["qwen2"].target
    full = load_shard(path, None, embed=True, head=True, dtype=torch.float32, fused=False)
    fused = load_shard(path, None, embed=True, head=True, dtype=torch.bfloat16, fused=True)
    plain = load_shard(path, None, embed=True, head=True, dtype=torch.bfloat16, fused=False)
    x = torch.arange(3, 33) % full.config.vocab_size
    want = full(x, 0, KVCache(), 30)
    err_fused = float((fused(x, 0, KVCache(), 30).float() - want).abs().max())
    err_plain = float((plain(x, 0, KVCache(), 30).float() - want).abs().max())
    assert err_fused <= 1.25 * err_plain + 1e-2


def test_batched_rounds_of_a_7b_shard_stay_fused():
    """The score budget takes batched rounds of a 7B shard over 8,192-position caches (16 x 9 tokens)
    and sends a long prompt's prefill to the HF layers."""
    from types import SimpleNamespace

    from workers.engine.shard import Shard

    shard = SimpleNamespace(fused=SimpleNamespace(heads=28))
    fits = Shard._fused_fits
    assert fits(shard, torch.empty(16, 9, 0), [torch.ones(16, 1, 9, 8210, dtype=torch.bool)])  # type: ignore[arg-type]
    assert fits(shard, torch.empty(1, 137, 0), [torch.ones(1, 1, 137, 8210, dtype=torch.bool)])  # type: ignore[arg-type]
    assert not fits(shard, torch.empty(1, 2000, 0), [None, torch.ones(1, 1, 2000, 8210, dtype=torch.bool)])  # type: ignore[arg-type]


def test_capture_takes_every_bucket_and_length_up_front(models, monkeypatch):
    """A worker captures its graphs before its first job: one per batch bucket, shape and attended length up
    to graph_capture_len, each only once; a batch attends over the smallest length that holds its rows."""
    from workers.engine import runner, sizing

    made: list[tuple] = []
    monkeypatch.setattr(runner, "BatchGraph", lambda shard, run, pool, *key: made.append(key[:5]) or made)
    shard = load_shard(models["qwen2"].target, None, embed=True, head=True)
    gather = Settings(engine={"static": True, "max_len": 3000, "attention": "gather"})
    engine = Engine(shard, gather, slots=6, step_tokens=3, max_draft=5)
    engine.graphs = True  # as on CUDA
    full = engine.pool.index.shape[0]
    assert sizing.attended_lengths(engine.pool) == [512, 1024, 2048, full]
    assert [engine.attended(engine.pool, n) for n in (1, 512, 513, 2049)] == [512, 512, 1024, full]
    assert engine.capture([(3, 0, 0), (1, 1, 4)]) == 24 and engine.capture([(3, 0, 0)]) == 0
    want = [(b, t, p, s, n) for b in (1, 2, 4, 6) for t, p, s in ((3, 0, 0), (1, 1, 4)) for n in (512, 1024, 2048)]
    assert sorted(made) == sorted(want)
    # attending in place, every batch reads its rows' own lengths: one graph per bucket and shape up to LONG_REACH
    # (1,024) captured up front, one past it (keys read in chunks) at first use
    made.clear()
    in_place = Settings(engine={"static": True, "max_len": 3000, "attention": "in_place"})
    engine = Engine(shard, in_place, slots=6, step_tokens=3, max_draft=5)
    engine.graphs = True
    assert [engine.attended(engine.pool, n) for n in (1, 1024, 1025, 2049)] == [1024, 1024, full, full]
    assert engine.capture([(3, 0, 0), (1, 1, 4)]) == 8
    assert sorted(made) == sorted((b, t, p, s, 1024) for b in (1, 2, 4, 6) for t, p, s in ((3, 0, 0), (1, 1, 4)))


@torch.inference_mode()
def test_attending_over_a_prefix_equals_the_whole_slot(models):
    """A batch whose rows sit below an attended length gets the same hidden states as attending over the
    whole slot (the positions past it are masked out anyway)."""
    shard = load_shard(models["qwen2"].target, None, embed=True, head=True)
    pool = KVPool.for_shard(shard, slots=2, max_len=1500, scratch=8)
    rows, x = torch.tensor([0, 1]), torch.randint(0, shard.config.vocab_size, (2, 40))
    pos = torch.arange(40).expand(2, 40).clone()
    whole = shard.run_batch(x, pos, BatchView(pool, rows, pos), None)
    part = shard.run_batch(x, pos, BatchView(pool, rows, pos, 512), None)
    assert torch.allclose(whole, part, atol=1e-5)


def test_slots_are_sized_from_the_memory_a_worker_may_fill(models, monkeypatch):
    """With no --slots, a CUDA worker's caches get what gpu_memory leaves after its weights and what other
    processes hold, less graph_reserve, in whole slots from 1 to max_slots (a CPU worker: cpu_slots)."""
    from workers.engine import sizing

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 10 * gib)
    free = {"now": 90 * gib}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free["now"], 100 * gib))
    engine = {"gpu_memory": 0.5, "graph_reserve": 0.2, "max_slots": 64, "cuda_context_gib": 0, "short_cache_len": 0}
    cfg, dev = Settings(engine=engine), torch.device("cuda:0")

    def fit(slot: int, settings: Settings = cfg) -> int:
        return sizing.memory_plan([(dev, lambda n: slot, 0)], 8192, settings).total

    assert fit(gib) == 32  # (50 - 10) * 0.8 GiB, 1 GiB a slot
    free["now"] = 20 * gib  # another process holds most of the device
    assert fit(gib) == 16
    assert fit(gib // 8, cfg.replace(engine={"gpu_memory": 30.0})) == 64
    assert fit(1000 * gib) == 1
    shard = load_shard(models["qwen2"].target, None, embed=True, head=True)
    assert Engine(shard, Settings(engine={"static": True, "max_len": 64, "cpu_slots": 5})).slots == 5
