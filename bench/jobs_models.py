"""The models of the job-path benchmark (bench/jobs.py): the target it runs (a local dir, a hub id or a
`random:` preset of bench/synthetic.py), its prompts and their reference outputs (HF `generate`). Not run on its
own: see `python -m bench.jobs --help`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import click


def say(msg: str) -> None:
    click.echo(f"[jobs {time.strftime('%H:%M:%S')}] {msg}", err=True)


@dataclass(frozen=True)
class Model:
    name: str
    target: str
    layers: int
    split: int
    draft: str | None
    vocab: int
    tokenizer: str | None  # a directory to load the tokenizer from; None: random prompt ids


def random_preset(name: str) -> dict:
    """The shape of a `random:<preset>` target, from the benchmark plugin (or where it lived before)."""
    import importlib

    for mod in ("bench.synthetic", "workers.engine.shard"):
        try:
            presets = getattr(importlib.import_module(mod), "RANDOM_PRESETS", None)
        except ImportError:
            continue
        if presets and name in presets:
            return presets[name]
    raise click.BadParameter(f"unknown random preset {name!r}", param_hint="--target")


def resolve_model(
    tiny: bool, smollm: bool, target: str | None, split: int | None, draft: str | None, tmp: Path
) -> Model:
    """The model the bench runs, from --tiny (built into `tmp`), --smollm (the demo's SmolLM2) or --target."""
    from transformers import AutoConfig

    from producer.local import layer_count

    if sum([tiny, smollm, target is not None]) != 1:
        raise click.UsageError("give exactly one of --tiny, --smollm or --target DIR")
    name, tokenizer = target or "", None  # tokenizer: where prompts are tokenized from (None: random ids)
    if tiny:  # random weights: random prompt ids
        from workers.tiny_models import save_tiny_model

        name, target = "tiny (random qwen2, 4 layers)", str(save_tiny_model(tmp / "tiny", "qwen2"))
    elif smollm:
        from producer.demo import smollm2_dir

        name, target = "SmolLM2-135M-Instruct", str(smollm2_dir())
    assert target is not None
    if target.startswith("random:"):
        preset = random_preset(target.split(":", 1)[1])
        n_layers, vocab = int(preset["num_hidden_layers"]), int(preset["vocab_size"])
    else:
        n_layers, vocab = layer_count(target), int(AutoConfig.from_pretrained(target).vocab_size)
        if not tiny and any((Path(target) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = target
    split = split if split is not None else n_layers // 2
    if not 0 < split < n_layers:
        raise click.BadParameter(f"{split}: the model has {n_layers} layers", param_hint="--split")
    return Model(name, target, n_layers, split, draft, vocab, tokenizer)


def build_prompts(model: Model, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` token ids: varied text through the tokenizer, or random
    in-vocabulary ids for models without one (random weights, where text means nothing anyway)."""
    rng = random.Random(seed)
    if model.tokenizer is None:
        return [[rng.randrange(model.vocab) for _ in range(length)] for _ in range(count)]
    from transformers import AutoTokenizer

    from workers.tiny_models import CORPUS, PROMPTS

    tok = AutoTokenizer.from_pretrained(model.tokenizer)
    sentences = [*CORPUS, *PROMPTS]
    out: list[list[int]] = []
    for i in range(count):
        ids = tok.encode(f"Request {i}.", add_special_tokens=False)
        while len(ids) < length:
            ids += tok.encode(" " + " ".join(rng.sample(sentences, len(sentences))), add_special_tokens=False)
        out.append(ids[:length])
    return out


class PathCheck:
    """HF's own logits along a job's whole output, teacher-forced in one forward (the target loaded once, where first
    needed): how far, at worst, the output's tokens were from generate's best choice at each step."""

    def __init__(self, target: str, dtype: str, device: str) -> None:
        self.target, self.dtype, self.device = target, dtype, device
        self._model = None

    def worst_ulps(self, prompt: list[int], got: list[int]) -> float:
        """Over the steps of `got`, the most units in the last place (of the dtype, at the step's best logit) by
        which its token's logit fell short of the best one (0: `got` is HF's greedy path throughout)."""
        import torch
        from transformers import AutoModelForCausalLM

        from workers.tiny_models import divergence_ulps

        if self._model is None:
            dtype = "auto" if self.dtype == "auto" else getattr(torch, self.dtype)
            self._model = AutoModelForCausalLM.from_pretrained(self.target, dtype=dtype).to(self.device).eval()
        hf = self._model
        with torch.no_grad():
            ids = torch.tensor([prompt + got[:-1]], device=self.device)
            logits = hf(ids).logits[0, len(prompt) - 1 :].float().cpu()
        dtype = next(hf.parameters()).dtype
        steps = [divergence_ulps([g], [int(row.argmax())], [row], dtype) for g, row in zip(got, logits, strict=True)]
        return max((u for u in steps if u is not None), default=0.0)


class Reference(list[int]):
    """One prompt's greedy continuation from HF `generate` (a list of token ids), with each step's best raw logits
    (`tops`: ids and values, generate's own) and the dtype it ran in: where a half-precision job parts from it,
    `tie_ulps` says whether that was at a rounding tie, and (with a `PathCheck`) whether the job's whole output is
    HF's greedy path up to such ties."""

    def __init__(
        self,
        ids: list[int],
        tops: list[tuple[list[int], list[float]]],
        dtype: str,
        prompt: list[int] | None = None,
        path: PathCheck | None = None,
    ) -> None:
        super().__init__(ids)
        self.tops, self.dtype, self.prompt, self.path = tops, dtype, prompt, path

    def tie_ulps(self, got: list[int]) -> float | None:
        """Where `got` first parts from this reference, how many units in the last place of the dtype generate's
        logits put its token and `got`'s apart; with a `PathCheck`, the most of that and of every later step's
        shortfall (the output after a tie must still be the greedy path from there). None where no tie can be told:
        float32, both tokens not among the kept logits (generate's processors may pick other than the raw best),
        or a kept logit not finite."""
        import math

        import torch

        from workers.tiny_models import divergence_ulps

        i = next((i for i, (a, b) in enumerate(zip(got, self, strict=False)) if a != b), None)
        if i is None or self.dtype == "float32" or i >= len(self.tops):
            return None
        kept = dict(zip(*self.tops[i], strict=True))
        if got[i] not in kept or self[i] not in kept or not all(map(math.isfinite, kept.values())):
            return None
        logits = torch.full((max(kept) + 1,), float("-inf"))
        logits[list(kept)] = torch.tensor(list(kept.values()))
        first = divergence_ulps([got[i]], [self[i]], [logits], getattr(torch, self.dtype))
        if first is None or self.path is None or self.prompt is None:
            return first
        return max(first, self.path.worst_ulps(self.prompt, got))


def hf_references(model: Model, prompts: list[list[int]], new: int, device: str, dtype: str) -> list[Reference]:
    """Greedy continuations of the unsplit target: `generate(do_sample=False)` per prompt, in the workers' dtype
    (`auto`: the checkpoint's), each step's four best logits kept, and a `PathCheck` for outputs that part at a
    tie (`Reference`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from workers.tiny_models import greedy_with_logits

    hf = AutoModelForCausalLM.from_pretrained(model.target, dtype="auto" if dtype == "auto" else getattr(torch, dtype))
    hf = hf.to(device).eval()
    ran = str(next(hf.parameters()).dtype).removeprefix("torch.")
    path, refs = PathCheck(model.target, ran, device), []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want, logits = greedy_with_logits(hf, torch.tensor([p], device=device), new)
            tops = [step[0].float().topk(4) for step in logits]
            refs.append(Reference(want, [(t.indices.tolist(), t.values.tolist()) for t in tops], ran, p, path))
            if (i + 1) % 16 == 0:
                say(f"references: {i + 1}/{len(prompts)}")
    del hf
    return refs
