"""The small registry through which code ShardFlow does not ship plugs into a worker.

A plugin is a module named when a worker starts (`shardflow head --plugin bench.synthetic`, also
`SHARDFLOW_PLUGINS=mod1,mod2`); the worker imports it and calls its `register(registry)`, which may add:

- a **drafter kind**: requests with `draft.kind == <name>` get a session from `factory(options, ctx)`,
  where `options` is the request's `draft.options` (the plugin validates them) and `ctx` says what the
  head has (prompt length, vocabulary, a session of its draft model, if any);
- a **model scheme**: targets named `<scheme>:<rest>` load from `resolve(rest)` (a config, a weight
  source and optionally a tokenizer) instead of a directory or hub id.

Nothing is registered by default: a production worker refuses plugin drafter kinds and scheme targets
with a clear error. `bench/synthetic.py` is the example (synthetic acceptance, random-weight presets).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from schemas.errors import InvalidRequest, ModelLoadError
from schemas.requests import BUILTIN_DRAFTERS
from schemas.settings import EngineSettings
from workers.engine.chain import ChainShard, load_chain
from workers.engine.shard import Shard, Source, load_shard
from workers.engine.wrappers import text_config
from workers.speculative.drafters import DraftSession


@dataclass(frozen=True)
class DrafterContext:
    """What a plugin drafter may use: the prompt's length, the target's vocabulary, and a session of the
    head's draft model (None without one) that it may run or close."""

    prompt_len: int
    vocab_size: int
    model_session: DraftSession | None


DrafterFactory = Callable[[dict[str, Any], DrafterContext], DraftSession]


@dataclass(frozen=True)
class ModelSource:
    """A target that is not a checkpoint: its config, where its weights come from, its tokenizer (anything
    with `encode`, `decode` and `chat_template`, as a transformers tokenizer) and EOS ids."""

    config: PretrainedConfig
    weights: Source
    tokenizer: object
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class Registry:
    """Drafter kinds and model schemes the loaded plugins added (empty for a production worker)."""

    drafters: dict[str, DrafterFactory] = field(default_factory=dict)
    schemes: dict[str, Callable[[str], ModelSource]] = field(default_factory=dict)
    plugins: list[str] = field(default_factory=list)

    def add_drafter(self, kind: str, factory: DrafterFactory) -> None:
        if kind in BUILTIN_DRAFTERS or kind in self.drafters:
            raise ValueError(f"drafter kind {kind!r} is taken")
        self.drafters[kind] = factory

    def add_scheme(self, scheme: str, resolve: Callable[[str], ModelSource]) -> None:
        if not scheme.isidentifier() or scheme in self.schemes:
            raise ValueError(f"model scheme {scheme!r} is taken or not a name")
        self.schemes[scheme] = resolve

    def drafter(self, kind: str, options: dict[str, Any], ctx: DrafterContext) -> DraftSession:
        """A plugin drafter's session; InvalidRequest (the job fails, not retried) if no plugin has it."""
        factory = self.drafters.get(kind)
        if factory is None:
            raise InvalidRequest(
                f"drafter kind {kind!r} is not available on this worker (a plugin drafter: start the head with "
                "--plugin naming the module that provides it)"
            )
        return factory(options, ctx)

    def source(self, target: str | Path) -> ModelSource | None:
        """The plugin source of a `<scheme>:<rest>` target, None for a directory or hub id."""
        scheme, sep, rest = str(target).partition(":")
        if not sep or Path(target).exists() or "/" in scheme:
            return None
        resolve = self.schemes.get(scheme)
        if resolve is None:
            if scheme.isidentifier() and scheme not in ("http", "https"):
                raise ModelLoadError(f"model scheme {scheme!r} of {target!r} needs a plugin (--plugin)")
            return None
        return resolve(rest)

    def config(self, target: str | Path) -> PretrainedConfig:
        """A target's config without its weights: a plugin source's, a directory's, or a hub id's config.json."""
        src = self.source(target)
        if src is not None:
            return src.config
        try:
            return text_config(AutoConfig.from_pretrained(str(target)))  # a multimodal wrapper's: its text model's
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{target!r} is neither a local directory nor a reachable hub model: {e}") from None

    def load_shard(
        self,
        target: str | Path,
        layers: tuple[int, int] | None,
        *,
        embed: bool,
        head: bool,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        fused: bool = True,
        quant: str = "none",
    ) -> Shard:
        """engine.shard.load_shard, through a plugin's source when the target names a scheme."""
        src = self.source(target)
        weights = None if src is None else (src.config, src.weights)
        opts = dict(embed=embed, head=head, device=device, dtype=dtype, fused=fused, quant=quant)
        return load_shard(target, layers, **opts, source=weights)  # type: ignore[arg-type]

    def load_for(
        self, target: str | Path, layers: tuple[int, int] | None, engine: EngineSettings, *, embed: bool, head: bool
    ) -> Shard:
        """`load_shard` as a worker's engine settings say: device, dtype, quant, fused layers."""
        dtype = None if engine.dtype == "auto" else getattr(torch, engine.dtype)
        opts = dict(device=engine.device, dtype=dtype, fused=engine.fused_layers, quant=engine.quant)
        return self.load_shard(target, layers, embed=embed, head=head, **opts)  # type: ignore[arg-type]

    def load_layers(
        self,
        target: str | Path,
        layers: tuple[int, int],
        engine: EngineSettings,
        *,
        embed: bool,
        head: bool,
        first_extra: int = 0,
    ) -> Shard | ChainShard:
        """A worker's layers: `load_for` on its device, or with engine.devices a `ChainShard` over them
        (workers/engine/chain.py; `first_extra`: bytes beside the first device's range, a head's drafter there)."""
        if not engine.devices:
            return self.load_for(target, layers, engine, embed=embed, head=head)
        dtype = None if engine.dtype == "auto" else getattr(torch, engine.dtype)

        def load(part: tuple[int, int], *, embed: bool, head: bool, device: str) -> Shard:
            return self.load_for(target, part, engine.model_copy(update={"device": device}), embed=embed, head=head)

        config = self.config(target)
        opts = dict(embed=embed, head=head, first_extra=first_extra, dtype=dtype, quant=engine.quant)
        return load_chain(load, config, layers, engine.devices, **opts)  # type: ignore[arg-type]

    def load_draft(self, target: str | Path, engine: EngineSettings) -> Shard:
        """A head's whole draft model as its engine settings say: on draft_device (default: device), draft_quant."""
        where = {"device": engine.draft_device or engine.device, "quant": engine.draft_quant}
        return self.load_for(target, None, engine.model_copy(update=where), embed=True, head=True)


def load_plugins(modules: Iterable[str]) -> Registry:
    """Import each module and let it `register(registry)`; a module that is missing or lacks `register`
    is a ModelLoadError naming it."""
    registry = Registry()
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise ModelLoadError(f"plugin {name!r} cannot be imported: {e}") from None
        register = getattr(module, "register", None)
        if not callable(register):
            raise ModelLoadError(f"plugin {name!r} has no register(registry) function")
        register(registry)
        registry.plugins.append(name)
    return registry
