"""Keeping a GPU's clocks up across the network wait between rounds (`keep_warm_ms`, off by default).

An idle GPU drops to its lowest clocks within milliseconds (an H200 idles at 345 MHz, boosts to 1,980),
and a round's first kernels after a WAN round trip then run slow: `bench/profile_round.py` measures
each stage ~0.5 ms slower after an 87 ms idle gap than back to back. With `keep_warm_ms` > 0 a worker
leaves one single-block spin kernel (`torch.cuda._sleep`) running on a stream of its own after each
round, for about that long: one SM of the GPU stays busy, so its clocks stay up until the next round
comes. It costs power while waiting, nothing else: the spin runs beside the real work (other streams;
the workers synchronise streams, never the whole device).
"""

from __future__ import annotations

import time

import torch

_CYCLES_PER_MS = 2.0e6  # spin length at a 2 GHz clock: at lower clocks a spin lasts longer, never shorter


class KeepWarm:
    """One spin stream per device; `after_round` extends the busy time to `ms` from now."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._until: dict[torch.device, float] = {}

    def after_round(self, device: torch.device) -> None:
        """Keep `device` busy for about `ms` from now (a no-op off CUDA or when off)."""
        if self.ms <= 0 or device.type != "cuda":
            return
        now = time.monotonic()
        if self._until.get(device, 0.0) - now > self.ms / 2000:  # the spin running still covers most of it
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(self.ms * _CYCLES_PER_MS))
        self._until[device] = now + self.ms / 1000
