"""The head side of a split generation: drafter + lower shard, talking to a tail through Redis.

    runtime = HeadRuntime.load("Qwen/Qwen2.5-7B-Instruct", layers=(0, 14), draft="Qwen/Qwen2.5-0.5B-Instruct")
    result = generate(GenerationRequest(prompt="Hello"), runtime, connect(url))

Each round: draft up to K tokens, run the lower shard over [uncached committed tokens, drafts], send
one packet, wait for the verdict, commit, and roll the shard's KV cache back to the committed prefix
(the drafter re-syncs itself at its next proposal). The first round goes to the shared tail stream;
later rounds go to the tail that holds the session's cache.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypedDict, Unpack

import redis
import torch
from transformers import AutoTokenizer

from schemas.errors import InvalidRequest
from schemas.keys import Keys
from schemas.requests import GenerationRequest, GenerationResult
from schemas.settings import Settings
from workers.engine.chain import ChainShard, WorkerEngine, WorkerShard, make_engine, whole_bytes
from workers.engine.per_layer import id_limit
from workers.engine.preflight import same_device
from workers.engine.runner import Engine
from workers.engine.shard import Shard, resolve_model_dir
from workers.engine.sizing import (
    SlotPlan,
    cache_len,
    cache_modes,
    engine_slot_cost,
    linger_s,
    memory_plan,
    ring_slack,
    shard_workspace,
    slot_cost,
)
from workers.head.batching import Batcher
from workers.head.beacon import Beacons
from workers.head.generation import Generation
from workers.head.groups import GroupPlan
from workers.head.link import LinkMeter
from workers.head.loop import HeadLoop
from workers.head.prompts import encode_prompt
from workers.head.routes import Routes
from workers.plugins import DrafterContext, Registry
from workers.speculative.drafters import DraftSession, ModelDrafter, NgramDrafter

log = logging.getLogger("shardflow.head")
TokenCallback = Callable[[list[int], list[int]], None]


def eos_ids_of(model_dir: Path, config: object) -> list[int]:
    """EOS ids from generation_config.json (as `generate` uses them), else from the model config."""
    gen_cfg = model_dir / "generation_config.json"
    eos = json.loads(gen_cfg.read_text()).get("eos_token_id") if gen_cfg.exists() else None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


@dataclass
class HeadRuntime:
    """What a head worker keeps loaded: tokenizer, lower shard, optional draft model; its settings and the
    plugins it was started with (drafter kinds and model schemes beyond the built-in ones)."""

    tokenizer: object
    shard: WorkerShard
    draft_model: ModelDrafter | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    engine: WorkerEngine | None = None  # how the shard runs (dynamic/static cache, CUDA graphs)
    lock: threading.RLock = field(default_factory=threading.RLock)  # one batch computes at a time
    settings: Settings = field(default_factory=Settings)
    plugins: Registry = field(default_factory=Registry)
    name: str | None = None  # how tails know this head (its worker name; default: host-pid-random)
    batcher: Batcher = field(init=False)
    beacons: Beacons = field(init=False)
    link: LinkMeter = field(init=False)  # the link to Redis, measured from the loops' publishes
    routes: Routes = field(init=False)  # the middle stages a new session's rounds go through

    def __post_init__(self) -> None:
        if self.engine is None:
            self.engine = make_engine(self.shard, self.settings)
        # a CPU head and its tail usually share their cores: a split would leave nothing idle to fill
        groups = self.settings.relay.head_groups or (None if self.shard.device.type == "cuda" else 1)
        plan = GroupPlan(fixed=groups)
        self.batcher = Batcher(self.engine, plan, linger_s(self.shard, self.settings))
        self.beacons = Beacons(self.name, self.settings)
        self.routes = Routes(self.shard.layer_range[1])
        self.link = LinkMeter(wire_codec=self.settings.relay.wire_codec, wire=self.settings.relay.wire)
        self._loops: dict[int, tuple[redis.Redis, HeadLoop]] = {}
        self._loops_lock = threading.Lock()

    def loop_for(self, r: redis.Redis) -> HeadLoop:
        """The step loop that runs this head's generations on connection `r` (one thread, made on first use)."""
        with self._loops_lock:
            if id(r) not in self._loops:
                self._loops[id(r)] = (r, HeadLoop(self, r))
            return self._loops[id(r)][1]

    def slot_freed(self) -> None:
        """A generation gave its cache slots back: every loop's waiting generations try again (`Schedule.freed`)."""
        with self._loops_lock:
            loops = [loop for _, loop in self._loops.values()]
        for loop in loops:
            loop.slot_freed()

    @classmethod
    def load(
        cls,
        target: str | Path,
        layers: tuple[int, int],
        *,
        draft: str | Path | None = None,
        settings: Settings | None = None,
        plugins: Registry | None = None,
    ) -> HeadRuntime:
        """Load the target's tokenizer and layers [a, b) (+ embedding), and the draft model if given.

        `settings` (default: Settings()) says how, in its engine group: device, dtype, quant, static caches and
        CUDA graphs (default: on for CUDA devices), the cache length, the batch slots, the graphs' draft length
        (graph_k), fused layers, and for the draft model compile_draft (torch.compile), draft_quant and
        draft_device (default: the shard's device; drafts reach the shard as host ids, as they reach the packet,
        so another local GPU costs no extra host sync); `plugins` may add drafter kinds and model schemes
        (workers/plugins.py)."""
        settings, plugins = settings or Settings(), plugins or Registry()
        dshard = plugins.load_draft(draft, settings.engine) if draft else None
        beside = dshard is not None and same_device(str(dshard.device), settings.engine.device)
        dtype = torch.float32 if settings.engine.dtype == "auto" else getattr(torch, settings.engine.dtype)
        # its bytes beside the first device's layers, counted as the preflight counts them (the same cuts)
        extra = whole_bytes(dshard.config, dtype, settings.engine.draft_quant) if beside and dshard is not None else 0
        shard = plugins.load_layers(target, layers, settings.engine, embed=True, head=False, first_extra=extra)
        if dshard is not None and dshard.config.vocab_size < shard.config.vocab_size:
            raise InvalidRequest("the draft model's vocabulary is smaller than the target's")
        k = settings.engine.graph_k
        slots = _joint_slots(shard, dshard, settings)
        drafter = None
        if dshard is not None:
            compile_draft = settings.engine.compile_draft
            dengine = Engine(
                dshard,
                settings,
                step_tokens=2,
                pad=False,
                compile=compile_draft,
                max_draft=k,
                slots=slots,
                label="draft",
            )
            drafter = ModelDrafter(dshard, dengine)
        engine = make_engine(shard, settings, slots=slots, label="head")
        source = plugins.source(target)
        if source is not None:  # a plugin's model: its tokenizer and EOS ids
            tok, eos = source.tokenizer, list(source.eos_token_ids)
        else:
            model_dir = resolve_model_dir(target)
            tok, eos = AutoTokenizer.from_pretrained(model_dir), eos_ids_of(model_dir, shard.config)
        runtime = cls(tok, shard, drafter, eos, engine, settings=settings, plugins=plugins)
        runtime.warm_up()
        return runtime

    def warm_up(self) -> int:
        """Capture the CUDA graphs greedy rounds replay (every batch bucket: the lower shard's padded round, the
        draft model's whole drafts) before the first job; the number captured (0 without graphs). Sampled
        drafts' step graphs are captured at first use."""
        assert self.engine is not None
        n = self.engine.capture([(self.engine.step_tokens, 0, 0)])  # hidden states of a padded round
        if self.draft_model is not None:
            d = self.draft_model.engine  # whole drafts from feeds of 1 or 2 new tokens
            n += d.capture([(t, 1, d.max_draft) for t in (1, 2)] if d.max_draft else [])
        if n:
            log.info("captured %d CUDA graphs", n)
        return n

    @property
    def capacity(self) -> int:
        """Generations a head worker takes at once by default: its engine's batch slots, and `jobs.ahead` more
        (default a sixteenth of them) that wait on the step loop for the next slot freed (Schedule.freed)."""
        assert self.engine is not None
        slots, ahead = self.engine.slots, self.settings.jobs.ahead
        return slots + (max(1, slots // 16) if ahead is None else ahead)

    @property
    def context_length(self) -> int | None:
        """The longest prompt + new tokens this runtime can hold: the model's limit, and its static caches'."""
        limits = [getattr(self.shard.config, "max_position_embeddings", None)]
        engines = [self.engine] + ([self.draft_model.engine] if self.draft_model is not None else [])
        limits += [e.max_len for e in engines if e is not None and e.static]
        return min((x for x in limits if x), default=None)

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        """Token ids of the request's prompt; raises InvalidRequest if it cannot fit the model."""
        # the vocabulary, or a smaller per-layer table (Gemma 4) whose lookups are unchecked: `per_layer.id_limit`
        return encode_prompt(self.tokenizer, req, id_limit(self.shard.config), self.context_length)

    def drafter_for(self, req: GenerationRequest, prompt_len: int, overflow: bool = True) -> DraftSession | None:
        """The draft session a request asks for ('model' falls back to n-gram without a draft model); NoFreeSlot
        where the draft model has no free slot its length fits and not `overflow`."""
        if req.draft.kind == "none" or req.draft.k == 0:
            return None
        need = prompt_len + req.max_new_tokens + req.draft.k + 1  # positions the draft cache may hold
        if req.draft.kind == "model" and self.draft_model is not None:
            return self.draft_model.new_session(need, overflow)
        if req.draft.kind in ("model", "ngram"):
            return NgramDrafter(req.draft.ngram_max, req.draft.ngram_min)
        inner = self.draft_model.new_session(need, overflow) if self.draft_model is not None else None
        ctx = DrafterContext(prompt_len, self.shard.config.vocab_size, inner)
        try:
            return self.plugins.drafter(req.draft.kind, dict(req.draft.options), ctx)
        except BaseException:
            if inner is not None:
                inner.close()
            raise


def _joint_slots(shard: WorkerShard, dshard: Shard | None, cfg: Settings) -> SlotPlan | None:
    """Slots for the lower shard's and the draft model's caches together (full-length and short ones, each
    costing both models' slots), sized from the devices' memory when the settings name none and the caches
    are static on CUDA devices: each device's entry costs what every part on it holds a slot (the lower layers
    of a `ChainShard` over several devices, the drafter on its own device or beside a part), the largest
    workspace of them kept free; as many as engine.cpu_slots where the shard's caches are dynamic (a static
    drafter planned alone took all the memory); None: each engine decides."""
    if cfg.engine.slots is not None or shard.device.type != "cuda":
        return None
    parts = shard.parts if isinstance(shard, ChainShard) else [shard]
    if not cache_modes(parts[0], cfg.engine)[0]:  # dynamic caches (--dynamic-cache): its drafter holds as many
        return SlotPlan(cfg.engine.cpu_slots)
    k, n_max = cfg.engine.graph_k, min(cache_len(p, cfg) for p in parts)
    costs: dict[torch.device, list[Callable[[int], int]]] = {}
    spaces: dict[torch.device, int] = {}
    for p in parts:  # a slot of the lower layers (the graphs' rows included), each part on its device
        costs.setdefault(p.device, []).append(partial(slot_cost, p, step_tokens=k + 1, scratch=k + 1,
                                                      ring_slack=ring_slack(cfg, k + 1, 0)))  # fmt: skip
        spaces[p.device] = max(spaces.get(p.device, 0), shard_workspace(p, cfg))
    if dshard is not None:  # and its copies; one prefill at a time on a shared device: the larger workspace
        costs.setdefault(dshard.device, []).append(partial(engine_slot_cost, dshard, step_tokens=2, max_draft=k,
                                                           ring_slack=ring_slack(cfg, 2, k)))  # fmt: skip
        spaces[dshard.device] = max(spaces.get(dshard.device, 0), shard_workspace(dshard, cfg))
    entries = [(dev, partial(_summed, fs), spaces[dev]) for dev, fs in costs.items()]
    return memory_plan(entries, n_max, cfg)


def _summed(costs: list[Callable[[int], int]], n: int) -> int:
    return sum(cost(n) for cost in costs)


class GenerationOptions(TypedDict, total=False):
    """The keywords of `new_generation` and `generate`, beside the request, runtime and connection."""

    names: Keys | None  # the key prefix's names (None: Keys())
    session_id: str | None  # None: a fresh random id
    on_tokens: TokenCallback | None  # called with (new tokens, all generated) as verdicts commit them
    reply_timeout_s: float | None  # None: relay.reply_timeout_s
    resume: list[int] | None  # tokens already generated: a checkpoint of an earlier attempt


def new_generation(
    req: GenerationRequest, runtime: HeadRuntime, r: redis.Redis, **options: Unpack[GenerationOptions]
) -> Generation:
    """One split speculative generation (WAITING), ready for the head's step loop (`runtime.loop_for(r)`).

    `resume`: tokens already generated (a checkpoint of an earlier attempt); the generation goes on
    from there, its first round replaying prompt + those tokens onto a tail."""
    prompt = runtime.prompt_ids(req)
    if req.sampling.seed is None and not req.sampling.greedy:
        req = req.model_copy(update={"sampling": req.sampling.model_copy(update={"seed": secrets.randbits(62)})})
    return Generation(
        req=req,
        runtime=runtime,
        r=r,
        names=options.get("names") or Keys(),
        session_id=options.get("session_id") or secrets.token_hex(12),
        prompt=prompt,
        on_tokens=options.get("on_tokens"),
        reply_timeout_s=options.get("reply_timeout_s"),
        resume=options.get("resume"),
    )


def generate(
    req: GenerationRequest, runtime: HeadRuntime, r: redis.Redis, **options: Unpack[GenerationOptions]
) -> GenerationResult:
    """Run one split speculative generation against the tails reachable through `r`, on the head's step loop
    (batched with every other generation in flight there); blocks the caller until it ends. The keywords are
    `new_generation`'s (`GenerationOptions`)."""
    return new_generation(req, runtime, r, **options).run()
