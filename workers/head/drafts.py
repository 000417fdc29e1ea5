"""A group's drafts on the head: each generation's round as the step loop hands it in (`HeadWork`), and every round's
draft made for the group at once (`draft_all`): the model drafts of a group, greedy or sampled, advance together per
draft model (`propose_many`: one batched draft-model forward per draft position, or for an all-greedy group the whole
draft as one graph replay; plugin sessions around a model session get their inner model's draft, then `finish` it),
n-gram proposals run in one call (`propose_ngram_many`), other drafters propose one by one. A whole greedy draft is
not read back before the lower shard is queued behind it: the drafts a session proposes as they are join the lower
shard's ids on the device (`Drafted.ids`), so the device runs draft and lower shard with no host round trip between
them; `Drafted.read` reads them once both are queued (workers/head/batching.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from schemas.requests import SamplingParams
from workers.engine.shard import Cache
from workers.speculative.drafters import (
    Draft,
    DraftSession,
    GreedyLaunch,
    ModelDraftSession,
    NgramDrafter,
    launch_greedy_many,
    propose_many,
    propose_ngram_many,
)


@dataclass(eq=False)  # compared by identity: its fields hold tensors and caches
class HeadWork:
    """One generation's round, as the step loop hands it in (`RoundLoop.next_work`); the batch fills in draft, hidden
    and the stage times."""

    drafter: DraftSession | None
    context: list[int]  # committed tokens
    k: int  # drafts wanted
    sampling: SamplingParams
    gen: torch.Generator | None
    cache: Cache  # the lower shard's cache of this sequence
    pending: list[int]  # committed tokens the shard has not seen yet
    start: int  # their first position
    draft: Draft | None = None
    hidden: torch.Tensor | None = None
    draft_s: float = 0.0
    head_s: float = 0.0
    batch: int = 0  # rounds in the batch that computed it
    k_free: bool = False  # its cost did not depend on k (graphs: the longest draft and K + 1 rows for every row)
    route: str = ""  # the stream its packet goes to
    tag: tuple[str, int] | None = None  # (the batch's id, its rounds with the same route): a header made ahead's
    error: BaseException | None = None
    gen_state: torch.Tensor | None = field(default=None, init=False)  # a sampled draft's generator, as handed in

    def __post_init__(self) -> None:
        if self.gen is not None and not self.sampling.greedy:  # only sampled drafts draw from it
            self.gen_state = self.gen.get_state()


def model_session(w: HeadWork) -> ModelDraftSession | None:
    """The draft-model session that drafts for `w` in the batch (a sampled draft needs the round's generator)."""
    if w.k <= 0 or w.drafter is None or (w.gen is None and not w.sampling.greedy):
        return None
    session = w.drafter.model_session
    return session if isinstance(session, ModelDraftSession) else None


class Drafted:
    """A batch's drafts as its lower shard needs them: each item's `Draft` read already, or where its model draft
    sits on the device (`GreedyLaunch`), read only once the lower shard is queued behind it (`read`)."""

    def __init__(self, n: int) -> None:
        self.host: list[Draft | None] = [None] * n
        self.device: dict[int, tuple[GreedyLaunch, int]] = {}  # item -> (its launch, its session there)
        self.launches: list[GreedyLaunch] = []

    def ids(self, batch: list[HeadWork], device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """Every item's [pending tokens, drafts] back to back on `device` (one copy from the host; drafts still on
        the device copied in there) and each item's length."""
        flat: list[int] = []
        sizes: list[int] = []
        parts: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # by draft tensor: (it, flat at, its at)
        for i, w in enumerate(batch):
            row = list(w.pending)
            d, where = self.host[i], None
            if d is None and i in self.device:
                launch, j = self.device[i]
                where = launch.on_device(j)
                d = launch.known(j) if where is None else None
            if where is not None:
                k, (tensor, r) = launch.ks[j], where
                part = parts.setdefault(id(tensor), (tensor, [], []))
                part[1].extend(range(len(flat) + len(row), len(flat) + len(row) + k))
                part[2].extend(r * tensor.shape[1] + c for c in range(k))
                row += [0] * k
            elif d is not None:
                row += d.tokens
            flat += row
            sizes.append(len(row))
        n = len(flat)
        host = torch.tensor(flat + [x for _, at, src in parts.values() for x in (*at, *src)], dtype=torch.long)
        out = host.to(device, non_blocking=True)
        ids, at = out[:n], n
        for tensor, dst, _ in parts.values():
            m = len(dst)
            src = out[at + m : at + 2 * m].to(tensor.device)  # a draft model may sit on another GPU
            ids[out[at : at + m]] = tensor.view(-1)[src].to(device)
            at += 2 * m
        return ids, sizes

    def ready(self) -> bool:
        """Whether `read` would not wait for the device."""
        return all(launch.ready() for launch in self.launches)

    def read(self) -> list[Draft]:
        """Every item's draft (empty where none was wanted), reading those still on the device. Every launch is
        read, also one whose sessions all proposed alone: reading brings its sessions' record of their caches up to
        date (unread, the next round would feed their draft positions again)."""
        for launch in self.launches:
            launch.drafts()
        for i, (launch, j) in self.device.items():
            if self.host[i] is None:
                self.host[i] = launch.drafts()[j]
        return [d if d is not None else Draft([]) for d in self.host]


def draft_all(batch: list[HeadWork]) -> Drafted:
    """Every round's draft: model sessions batched per draft model, n-gram sessions in one call, the rest one by
    one. An all-greedy model batch is only queued on the device (`launch_greedy_many`): a session that is its own
    drafter leaves its draft there, one whose `finish` ignores the model draft (`proposes_alone`: it only pays its
    cost) finishes now, and any other reads the batch's drafts first."""
    out = Drafted(len(batch))
    models: dict[int, list[tuple[int, ModelDraftSession]]] = {}  # by draft engine: one batch per draft model
    for i, w in enumerate(batch):
        if (s := model_session(w)) is not None:
            models.setdefault(id(s.engine), []).append((i, s))
    for group in models.values():
        ws = [batch[i] for i, _ in group]
        sessions, contexts, ks = [s for _, s in group], [w.context for w in ws], [w.k for w in ws]
        if all(w.sampling.greedy for w in ws):
            launch = launch_greedy_many(sessions, contexts, ks)
            out.launches.append(launch)
            for j, ((i, s), w) in enumerate(zip(group, ws, strict=True)):
                if w.drafter is s:
                    out.device[i] = (launch, j)
                elif getattr(w.drafter, "proposes_alone", False):
                    out.host[i] = w.drafter.finish(Draft([]), w.context, w.k, w.gen)  # type: ignore[union-attr]
                else:
                    out.host[i] = w.drafter.finish(launch.drafts()[j], w.context, w.k, w.gen)  # type: ignore[union-attr]
            continue
        drafts = propose_many(sessions, contexts, ks, [w.sampling for w in ws], [w.gen for w in ws])
        for (i, _), w, d in zip(group, ws, drafts, strict=True):
            out.host[i] = w.drafter.finish(d, w.context, w.k, w.gen)  # type: ignore[union-attr]
    rest = [
        i for i, w in enumerate(batch) if i not in out.device and out.host[i] is None and w.k > 0 and w.gen is not None
    ]
    ngrams = [(i, d) for i in rest if isinstance(d := batch[i].drafter, NgramDrafter)]
    if ngrams:
        ws = [batch[i] for i, _ in ngrams]
        for (i, _), d in zip(
            ngrams, propose_ngram_many([d for _, d in ngrams], [w.context for w in ws], [w.k for w in ws]), strict=True
        ):
            out.host[i] = d
    for i in rest:
        w = batch[i]
        if out.host[i] is None and w.drafter is not None:
            out.host[i] = w.drafter.propose(w.context, w.k, w.sampling, w.gen)  # type: ignore[arg-type]
    return out
