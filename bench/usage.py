"""What a batch of bench/jobs.py uses while it runs, sampled in the background: GPU utilization
(`nvidia-smi --query-gpu=index,utilization.gpu -lms 200` in a subprocess) and the worker processes' thread
counts (`Threads:` of /proc/PID/status). Not run on its own: `python -m bench.jobs` reports both per N.

nvidia-smi's utilization.gpu is the share of its last sample period (1/6 s to 1 s, by product) in which
a kernel ran; read every 200 ms it may repeat a value. Without nvidia-smi, or with no worker on a CUDA
device, GPU utilization is skipped with a note; without /proc, thread counts are.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

THRESHOLD_PCT = 50.0  # a sample at or above this counts as busy
INTERVAL_MS = 200


def gpu_indices(devices: list[str]) -> list[int]:
    """nvidia-smi indices of the CUDA devices named ("cuda:1" -> 1; "cuda" -> 0), mapped through a numeric
    CUDA_VISIBLE_DEVICES; assumes CUDA's order is nvidia-smi's (PCI bus order: CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    out: set[int] = set()
    for d in devices:
        m = re.fullmatch(r"cuda(?::(\d+))?", d)
        if m is None:
            continue
        i = int(m.group(1) or 0)
        out.add(int(visible[i]) if visible and i < len(visible) and visible[i].isdigit() else i)
    return sorted(out)


class GpuSampler(threading.Thread):
    """Reads nvidia-smi's utilization lines per GPU index until `stop`."""

    def __init__(self, gpus: list[int], interval_ms: int = INTERVAL_MS) -> None:
        super().__init__(daemon=True, name="gpu-sampler")
        self.gpus, self.interval_ms = gpus, interval_ms
        self.samples: dict[int, list[float]] = {g: [] for g in gpus}
        self.proc: subprocess.Popen | None = None
        self.note: str | None = None
        exe = shutil.which("nvidia-smi")
        if not gpus:
            self.note = "no worker on a CUDA device: GPU utilization not recorded"
        elif exe is None:
            self.note = "nvidia-smi not found: GPU utilization not recorded"
        else:
            query = ["--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", str(interval_ms)]
            try:
                self.proc = subprocess.Popen(
                    [exe, *query], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
                )
            except OSError as e:
                self.note = f"nvidia-smi did not start ({e}): GPU utilization not recorded"

    def run(self) -> None:
        if self.proc is None or self.proc.stdout is None:
            return
        for line in self.proc.stdout:
            idx, _, util = line.partition(",")
            try:
                i, u = int(idx), float(util)
            except ValueError:  # "[N/A]", a header, a partial line
                continue
            if i in self.samples:
                self.samples[i].append(u)

    def stop(self) -> dict:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.is_alive():
            self.join(timeout=5)
        per_gpu = {str(g): summarize(xs) for g, xs in self.samples.items()}
        if self.note is None and not any(s["samples"] for s in per_gpu.values()):
            self.note = "nvidia-smi gave no utilization samples"
        return {"interval_ms": self.interval_ms, "threshold_pct": THRESHOLD_PCT, "per_gpu": per_gpu, "note": self.note}


def summarize(xs: list[float]) -> dict:
    """Samples, mean utilization and the share of samples at or above the threshold."""
    if not xs:
        return {"samples": 0, "mean_pct": None, "busy_share": None}
    busy = sum(1 for x in xs if x >= THRESHOLD_PCT) / len(xs)
    return {"samples": len(xs), "mean_pct": round(sum(xs) / len(xs), 1), "busy_share": round(busy, 3)}


def threads_of(pid: int) -> int | None:
    """A process's thread count (/proc/PID/status), None where it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^Threads:\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else None


def thread_names(pid: int) -> dict[str, int]:
    """How many of a process's threads bear each name (/proc/PID/task/*/comm; Python names them as threads do,
    truncated to 15 characters; CUDA's, torch's and OpenMP's threads carry the process's or their own names)."""
    names: dict[str, int] = {}
    for comm in Path(f"/proc/{pid}/task").glob("*/comm"):
        try:
            name = re.sub(r"\d+$", "#", comm.read_text().strip())
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items(), key=lambda kv: -kv[1]))


class ThreadSampler(threading.Thread):
    """Samples each named process's thread count every `interval_ms` until `stop`."""

    def __init__(self, pids: dict[str, int], interval_ms: int = INTERVAL_MS) -> None:
        super().__init__(daemon=True, name="thread-sampler")
        self.pids, self.interval_s = pids, interval_ms / 1000
        self.counts: dict[str, list[int]] = {role: [] for role in pids}
        self.names: dict[str, dict[str, int]] = {}  # each process's thread names at its largest count
        self.done = threading.Event()

    def run(self) -> None:
        while True:
            for role, pid in self.pids.items():
                if (n := threads_of(pid)) is not None:
                    if n > max(self.counts[role], default=0):
                        self.names[role] = thread_names(pid)
                    self.counts[role].append(n)
            if self.done.wait(self.interval_s):
                return

    def stop(self) -> dict:
        self.done.set()
        self.join(timeout=5)
        out: dict = {}
        for role, xs in self.counts.items():
            out[role] = (
                {
                    "samples": len(xs),
                    "max": max(xs),
                    "mean": round(sum(xs) / len(xs), 1),
                    "names_at_max": self.names.get(role, {}),
                }
                if xs
                else {"samples": 0, "max": None, "mean": None, "note": "/proc/PID/status not readable"}
            )
        return out


class Usage:
    """`with Usage(pids, devices) as u: ...` samples both while the block runs; `u.result` then holds
    {"gpu": ..., "threads": ..., "seconds": ...}."""

    def __init__(self, pids: dict[str, int], devices: list[str]) -> None:
        self.gpu, self.threads = GpuSampler(gpu_indices(devices)), ThreadSampler(pids)
        self.result: dict = {}

    def __enter__(self) -> Usage:
        self.t0 = time.monotonic()
        self.gpu.start()
        self.threads.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.result = {
            "gpu": self.gpu.stop(),
            "threads": self.threads.stop(),
            "seconds": round(time.monotonic() - self.t0, 2),
        }


def brief(usage: dict | None) -> tuple[str, str]:
    """(GPU "mean% / busy share" per GPU, "head / tail" max threads) for a report's table."""
    if not usage:
        return "—", "—"
    gpu = usage.get("gpu", {})
    cells = [
        f"{s['mean_pct']:.0f}% / {s['busy_share']:.2f}" + (f" (gpu {g})" if len(gpu.get("per_gpu", {})) > 1 else "")
        for g, s in gpu.get("per_gpu", {}).items()
        if s.get("samples")
    ]
    threads = usage.get("threads", {})
    t = " / ".join("—" if threads.get(r, {}).get("max") is None else str(threads[r]["max"]) for r in ("head", "tail"))
    return ("; ".join(cells) or "—"), t
