"""The one documented place for ShardFlow's configuration and defaults.

`Settings` groups them by concern: `redis` (the connection and key namespace), `jobs` (RQ, results,
waiting and following), `generation` (what a request gets unless it says), `engine` (how a worker runs
its shard: device, dtype, quantization, static caches, CUDA graphs and their sizes, batch slots, memory),
`relay` (head <-> tail packets, streams, sessions, the head's step loop) and `api` (`shardflow serve`).
A process builds one `Settings` (a worker command: the environment plus its flags) and passes it whole to
what it runs; code below reads the group it needs (`settings.engine.max_len`), never a process global.

From the environment, each field has exactly one name: `SHARDFLOW_<GROUP>__<FIELD>` (pydantic-settings' nested
delimiter, two underscores: `SHARDFLOW_REDIS__URL`, `SHARDFLOW_ENGINE__GPU_MEMORY`, `SHARDFLOW_JOBS__RESULT_TTL_S`);
lists are JSON (`SHARDFLOW_JOBS__RETRY_INTERVALS_S='[2, 10, 30]'`). A flag given on the command line wins over it.

The numbers live here only, as the groups' field defaults. A schema field whose default mirrors a setting
reads the group's class default (`GenerationSettings().draft_k`: no environment), never a process's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "SHARDFLOW_"  # of every environment name: SHARDFLOW_<GROUP>__<FIELD>

Quant = Literal["none", "int8", "4bit"]
WireCodec = Literal["auto", "none", "zstd"]  # how a head's rounds send their tensors (schemas/codec.py)
Wire = Literal["lossless", "fp8", "int8"]  # the precision of a head's hidden rows on the wire (schemas/codec.py)
DTypeChoice = Literal["auto", "float32", "bfloat16", "float16"]


class _Group(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RedisSettings(_Group):
    """Redis, as queue and relay: where it is, the key namespace, timeouts and reconnects."""

    url: str = Field("redis://127.0.0.1:6379/0", description="Redis as queue and relay.")
    prefix: str = Field("shardflow", description="Namespace of every relay key ShardFlow writes.")
    socket_timeout_s: float = Field(30.0, description="Redis socket timeout; must exceed block_ms.")
    connect_attempts: int = Field(8, description="Attempts for a Redis operation on transport errors.")
    reconnect_min_s: float = Field(0.5, description="First wait of a worker loop that lost Redis (then doubling).")
    reconnect_max_s: float = Field(10.0, description="Longest wait between a worker loop's reconnect attempts.")
    block_ms: int = Field(1000, description="Redis BLOCK time of stream reads.")
    hiredis: bool = Field(True, description="Parse replies with hiredis (C) where it is installed; false: in Python.")


class JobSettings(_Group):
    """Jobs (RQ): the queue, how long results stay, retries, heartbeats, waiting and following."""

    queue: str = Field("shardflow", description="RQ queue that head workers serve and producers fill.")
    result_ttl_s: int = Field(
        7 * 24 * 3600, description="How long everything a job writes is kept (results, failed jobs, text streams)."
    )
    max_batch_jobs: int = Field(100_000, description="Most jobs one batch may hold (job ids end in 5 digits).")
    timeout_s: int = Field(3600, description="Longest one job.")
    retries: int = Field(3, description="Automatic retries after a transient failure.")
    retry_intervals_s: list[int] = Field([2, 10, 30], description="Backoff between automatic retries.")
    ahead: int | None = Field(
        None,
        ge=0,
        description="Jobs a head worker takes beyond its batch slots when --concurrency names none, waiting for a slot "
        "on its step loop, so that a slot a generation frees is seated at once, not after a dequeue's round trips "
        "(None: a sixteenth of the slots, at least one).",
    )
    heartbeat_s: float = Field(2.0, description="Head worker heartbeat period while a job runs.")
    heartbeat_ttl_s: int = Field(8, description="A running job with no heartbeat this long is abandoned.")
    maintenance_s: int = Field(3, description="How often head workers look for abandoned jobs.")
    poll_interval_s: float = Field(0.3, description="How often `--wait` (Client.wait) polls job states.")
    follow_block_ms: int = Field(300, description="Blocking read of token streams by `--follow` (Client.follow).")
    follow_read_count: int = Field(64, description="Token-stream entries `--follow` reads per stream per call.")
    progress_interval_s: float = Field(0.2, description="Least time between progress/token updates of a job.")
    worker_restart_max_s: float = Field(30.0, description="Longest wait before a head worker restarts RQ's loop.")
    worker_restart_reset_s: float = Field(
        60.0, description="A head worker's RQ loop that ran this long before ending starts the restart backoff over."
    )


class GenerationSettings(_Group):
    """What a generation request gets when it names nothing (the request's own fields win)."""

    draft_k: int = Field(
        8,
        ge=0,
        le=64,
        description="Draft tokens a request proposes per round (K) unless it says; never the engines' graph sizes "
        "(engine.graph_k).",
    )
    ngram_max: int = Field(3, description="Longest n-gram the prompt-lookup drafter matches.")
    ngram_min: int = Field(1, description="Shortest n-gram the prompt-lookup drafter matches.")
    max_new_tokens: int = Field(128, description="Tokens generated when a request names none.")


class EngineSettings(_Group):
    """How a worker runs its shard (and a head its draft model): device, weights, caches, graphs, memory."""

    device: str = Field("cpu", description="Torch device of the shard, e.g. cpu, cuda:0.")
    devices: list[str] = Field(
        [],
        description='Devices of one machine one worker spreads its layers over, in order (e.g. ["cuda:0", '
        '"cuda:1"]: workers/engine/chain.py; no Redis between them), each holding about the same bytes of weights; '
        "empty: `device` alone. `device` is then the first of them (a head's drafter goes there by default).",
    )
    dtype: DTypeChoice = Field("auto", description="Weight dtype; auto = the checkpoint's.")
    quant: Quant = Field(
        "none", description="Weight-only quantization of the shard's layers (workers/engine/quant.py)."
    )
    draft_device: str | None = Field(None, description="Torch device of a head's draft model (None: device).")
    draft_quant: Quant = Field("none", description="Weight-only quantization of the draft model's layers.")
    compile_draft: bool = Field(False, description="Run the draft model through torch.compile.")
    draft_kernels: bool = Field(
        True,
        description="A draft model's steps run each layer as a few Triton kernels where Triton and CUDA are present "
        "(workers/engine/decode_kernels.py): six with GEMV kernels up to 4 token rows (a lone job's drafts), ten with "
        "cuBLAS GEMMs between them up to draft_kernel_rows; off: the fused forward.",
    )
    draft_kernel_rows: int = Field(
        1024, ge=0, description="Most token rows (sequences x tokens) of a draft step run through the kernels."
    )
    target_kernel_rows: int = Field(
        0, ge=0, description="Most token rows of a target shard's step (a batch's rounds) run through the draft steps' "
        "kernels on CUDA (decode_kernels.py); 0, the default until measured on the device: the fused forward.",
    )  # fmt: skip
    threads: int | None = Field(None, ge=1, description="CPU threads for torch (None: torch's).")
    static: bool | None = Field(
        None, description="Preallocated KV caches rolled back in place, run batched (None: on; graphs need them)."
    )
    graphs: bool | None = Field(None, description="Replay rounds' forwards as CUDA graphs (None: on a CUDA device).")
    fused_layers: bool = Field(
        True, description="Run Llama/Qwen2-style layers through the lean fused forward (workers/engine/fused.py)."
    )
    attention: Literal["auto", "gather", "in_place"] = Field(
        "auto",
        description="How fused layers attend over batched KV slots: in place, reading each row's slot where it sits "
        "(FlashAttention-2, workers/engine/pool_attention.py), or from a gathered copy of the batch's keys and "
        "values. auto: in place where that kernel runs (CUDA sm_80+, float16/bfloat16), else gather; in_place "
        "elsewhere runs its reference kernel (tests).",
    )
    max_len: int = Field(
        8192,
        ge=1,
        description="Positions a static KV cache holds (capped by the model's limit).",
    )
    window_slack: int | None = Field(
        80,
        ge=64,
        description="Positions a sliding-window layer's static cache keeps beyond its window, as a ring "
        "(workers/engine/rings.py): the furthest a sequence can roll back, so at least its longest round or whole "
        "draft (a request's k is at most 64, hence the floor; an engine never takes less than its graph steps and "
        "drafts). None: "
        "windowed layers keep every position, as full-attention layers do.",
    )
    graph_k: int = Field(
        8,
        ge=0,
        le=64,
        description="Draft tokens per round the engines' shapes are made for: head and tail rounds step graph_k + 1 "
        "tokens through their CUDA graphs, a draft model's whole drafts are graph_k long. A request's k above it "
        "still runs (those rounds eagerly); it never resizes them.",
    )
    slots: int | None = Field(
        None,
        ge=1,
        description="Sequences a worker's static caches hold and run as one batched forward; None: as many as "
        "gpu_memory leaves room for on a CUDA device (at most max_slots), cpu_slots on a CPU.",
    )
    gpu_memory: float = Field(
        0.9,
        gt=0,
        description="What a worker may fill of its CUDA device: a share of its memory (up to 1) or GiB (above "
        "1); the KV caches get what the weights leave of it, less graph_reserve. Lower it when workers share a GPU.",
    )
    cuda_context_gib: float = Field(
        2.0,
        ge=0,
        description="GiB a CUDA worker's process holds outside its allocator (the CUDA context, library handles, "
        "captured graphs; 0.6-1.7 measured on an H200, more with more graphs and 4-bit layers): gpu_memory bounds "
        "the whole process, the allocator gets the rest.",
    )
    graph_reserve: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="Share of the memory left after the weights kept for what is not counted per slot (prefills, "
        "workspaces, fragmentation); each slot is counted with its keys/values and its rows of the CUDA graphs.",
    )
    max_slots: int = Field(256, ge=1, description="Most sequences a worker holds with its caches sized from memory.")
    short_cache_len: int = Field(
        2048,
        ge=0,
        description="Positions of a short KV slot: a worker sized from memory keeps slots this long for sequences "
        "whose prompt and new tokens fit (most jobs), beside full-length ones; 0: full-length slots only. Where "
        "max_slots do not fit, short slots shrink in steps of 256 positions until they do, to short_cache_min.",
    )
    short_cache_min: int = Field(1024, ge=256, description="Fewest positions a short slot shrinks to.")
    long_slots_share: float = Field(
        0.25, gt=0, le=1, description="Share of the KV memory for full-length slots when there are short ones."
    )
    cpu_slots: int = Field(16, ge=1, description="Sequences a worker holds at once on a CPU, or with dynamic caches.")
    switch_interval_ms: float | None = Field(
        1.0,
        ge=0.05,  # shorter ones round to nothing in the interpreter
        description="A worker process's interpreter switch interval (sys.setswitchinterval): how soon a thread that "
        "waits for the interpreter lock gets it from a busy one (the head's senders and readers beside its loop). "
        "None keeps Python's 5 ms.",
    )
    cuda_torch_threads: int = Field(
        4, ge=1, description="torch's CPU threads on a CUDA device unless threads says (its host work is small)."
    )
    batch_linger_ms: float | None = Field(
        None,
        ge=0,
        description="How long a worker about to run a batch waits for more rounds of the generations in flight: "
        "a head for the rest of its group (at most a round's measured wait, within 4x to 50x this), a tail while "
        "a head batch's rounds keep coming (each within this of the last, at most 4 reads). None: 5 on a CPU, "
        "where a batched forward costs little more than one sequence's; 0 on CUDA.",
    )
    graph_capture_len: int = Field(
        2048,
        description="A worker captures its CUDA graphs for batches attending up to this many positions when it "
        "starts; batches of longer sequences capture theirs at first use.",
    )
    prefill_tokens: int = Field(
        8192,
        ge=1,
        description="Prompts of sequences in flight run as batched forwards of up to this many (padded) tokens.",
    )
    verify_warp_rows: int = Field(
        128,
        ge=1,
        description="Most logits rows of sampled rounds a tail warps at once (temperature, top-k, top-p: about 30 "
        "bytes per row and vocabulary entry while it runs) when it verifies a batch; more rows run in more steps.",
    )

    @model_validator(mode="before")
    @classmethod
    def _first_device(cls, data: Any) -> Any:
        """With `devices`, `device` is their first (named otherwise: an error, not a guess)."""
        if isinstance(data, dict) and data.get("devices"):
            devices = data["devices"]
            if isinstance(devices, str):
                devices = [d.strip() for d in devices.split(",") if d.strip()]
            if len(devices) < 2:
                raise ValueError("devices names at least two (one device: use device)")
            if data.get("device") not in (None, devices[0]):
                raise ValueError(f"device {data['device']!r} is not the first of devices {devices}")
            data = {**data, "devices": devices, "device": devices[0]}
        return data


class RelaySettings(_Group):
    """Head <-> tail: packets and their caps, streams and their expiries, tail sessions, the head's step loop."""

    max_packet_bytes: int = Field(64 << 20, description="Largest packet (header + tensors) accepted.")
    max_header_bytes: int = Field(1 << 20, description="Largest JSON header of a packet accepted.")
    max_tensor_elements: int = Field(1 << 26, description="Largest element count of one tensor.")
    request_stream_maxlen: int = Field(10_000, description="Approximate cap of a tail request stream.")
    dead_letter_maxlen: int = Field(100_000, description="Approximate cap of the dead-letter stream.")
    dead_letter_rate: float = Field(
        10.0,
        gt=0,
        description="Dead letters a head or tail writes per second for one source stream once dead_letter_burst are "
        "spent; the rest are only counted in its phase lines (a flood of junk never cycles the trail).",
    )
    dead_letter_burst: int = Field(100, ge=1, description="Dead letters one source stream may get at once.")
    read_max_bytes: int = Field(
        64 << 20,
        ge=1 << 16,
        description="About the most bytes a tail or head takes in one read of its streams: once an entry of n bytes "
        "came (within 10 s), a read takes at most this / n entries (one at least).",
    )
    reply_dead_letters_max: int = Field(
        32, description="Refused replies one generation dead-letters (more are only counted and logged)."
    )
    reply_ttl_s: int = Field(
        600, description="How long a head's reply stream outlives its last renewal (its beacon renews it)."
    )
    claim_idle_ms: int = Field(
        5000, description="A request left unacknowledged this long by a tail (dead) is claimed by a live one."
    )
    tail_stream_ttl_s: int = Field(
        3600, description="A tail's own request stream (and its idle group consumer) outlives the tail this long."
    )
    tail_keepalive_s: float = Field(
        60.0, description="How often a tail renews its stream's expiry and drops long-idle consumers of dead tails."
    )
    max_sessions: int = Field(256, ge=1, description="Sessions a tail keeps KV caches for (least recent go).")
    head_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of a tail's caches past which one head gets no new session while another head was "
        "refused one (within the reply timeout); a head alone may hold them all (workers/tail/liveness.py).",
    )
    session_ttl_s: float = Field(600.0, gt=0, description="Idle time after which a tail drops a session.")
    head_check_s: float = Field(
        1.0,
        gt=0,
        description="How often a tail checks that the heads of its sessions still run (their `head:NAME` keys): a "
        "restarted head's sessions go at once, a silent one's after its reply timeout (workers/tail/liveness.py).",
    )
    head_recheck_s: float = Field(
        0.05, gt=0, description="Soonest a tail checks the heads again when it is full or sees a head's new boot."
    )
    head_groups: int | None = Field(
        None,
        ge=1,
        description="Groups a head's generations in flight run in, their rounds interleaved; None: on CUDA picked "
        "from measured compute and link times (workers/head/groups.py), up to 4; one on a CPU.",
    )
    group_messages: bool = Field(
        True,
        description="A head sends a group's rounds for one tail stream as one entry (schemas/groups.py), not one "
        "entry per session.",
    )
    wire_codec: WireCodec = Field(
        "auto",
        description="How a head's rounds send their tensors, losslessly (schemas/codec.py): `none` raw; `zstd` byte "
        "planes, each zstd'd (SmolLM2's real bfloat16 hidden states in 7B-wide rounds, one core of a 2-core CPU: "
        "1.44x fewer bytes, 530 MB/s to encode, 1.26 GB/s to decode; float16 1.15x, float32 1.18x); `auto` zstd only "
        "on a link the head measures slow enough that it pays 3 times over (`worth_compressing`: below about 77 MB/s), "
        "raw otherwise and until it has measured. A tail decodes whatever a round's header names.",
    )
    wire: Wire = Field(
        "lossless",
        description="Precision of a head's hidden rows on the wire (`shardflow head --wire`): `lossless` as computed; "
        "`fp8` (float8 e4m3, a scale per row) or `int8` (a scale per 128 values) about halve a bfloat16 round's bytes "
        "(a quarter of float32's) and are LOSSY: greedy output may part from the unsplit model's (schemas/codec.py, "
        "README). Opt-in, never the default; q tensors stay lossless; the codes zstd'd where wire_codec compresses.",
    )
    accept_lossy_wire: bool = Field(
        True,
        description="A tail serves rounds whose hidden rows came 8-bit (relay.wire fp8/int8); false: it answers them "
        "with an error (the head replays the session onto another tail, then fails it).",
    )
    head_wait_poll_ms: float = Field(
        1.0,
        ge=0,
        description="While the device runs a group, the longest a head's step loop waits for a reply before it asks "
        "the device again: replies are taken as they come, not after the group's waits (workers/head/batching.py); "
        "0: each wait blocks in one sync.",
    )
    head_senders: int = Field(
        3,
        ge=1,
        description="Threads (each with its Redis connection) a head publishes rounds on: a group computed while "
        "another's publish is on the wire goes at once (workers/head/relay_io.py).",
    )
    head_readers: int = Field(
        2,
        ge=1,
        description="Threads a head reads its reply streams on (one consumer group): while one's answer travels "
        "back another's read waits at Redis, so a verdict is taken as it comes.",
    )
    mac_threads: int = Field(
        4,
        ge=1,
        description="Threads a tail unpacks a batch's group entries (one hash over each group's tensors) and checks "
        "its rounds' MACs on (hashlib lets go of the interpreter lock over large buffers, so they run side by side).",
    )
    reply_timeout_s: float = Field(
        15.0,
        description="A head: a verdict missing this long replays the session onto a live tail (tail crash). A tail: "
        "the longest it keeps a silent session whose head's key is gone or names another boot (a packet's own "
        "timeout, if shorter, counts), and how long a session of a head that never announced itself may live.",
    )
    tail_busy_wait_s: float = Field(
        0.1, gt=0, description="First wait before a head sends a new session's round again to a full tail (doubling)."
    )
    tail_busy_max_s: float = Field(2.0, gt=0, description="Longest wait between a head's rounds to full tails.")
    resume_attempts: int = Field(3, description="Replays of one generation before it fails (and RQ retries it).")


class ApiSettings(_Group):
    """`shardflow serve`, the OpenAI-compatible API: body and time limits, concurrency, the model it serves."""

    max_body_bytes: int = Field(32 << 20, ge=1024, description="Largest request body (and file).")
    max_concurrent: int = Field(256, ge=1, description="Requests handled at once; more are 429.")
    timeout_s: float = Field(3600.0, gt=0, description="Longest a completion waits for its job.")
    body_timeout_s: float = Field(30.0, gt=0, description="Longest a whole body may take (else 408).")
    max_json_depth: int = Field(64, ge=4, description="Deepest nesting of a JSON body or Batch line.")
    liveness_s: float = Field(1.0, gt=0, description="How long serve trusts its last look at heartbeats.")
    result_grace_s: float = Field(
        2.0,
        ge=0,
        description="How long serve re-reads a job recorded finished whose result it cannot read yet.",
    )
    shutdown_s: float = Field(10.0, ge=0, description="How long a stopping serve lets requests finish.")
    model_name: str | None = Field(
        None,
        description="The model name serve lists and accepts (None: the head's target directory or hub id).",
    )
    shared_batches: bool = Field(
        False,
        description="Every API key of `shardflow serve` sees every batch and file (else only its own).",
    )


class Settings(BaseSettings):
    """Configuration of one ShardFlow process, by concern (read-only once loaded; see the module's docstring)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        frozen=True,
        extra="ignore",
        nested_model_default_partial_update=True,
    )

    redis: RedisSettings = Field(default_factory=RedisSettings)
    jobs: JobSettings = Field(default_factory=JobSettings)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    relay: RelaySettings = Field(default_factory=RelaySettings)
    api: ApiSettings = Field(default_factory=ApiSettings)

    def replace(self, **groups: dict[str, Any]) -> Settings:
        """These settings with some fields of some groups changed, validated: `settings.replace(engine={"slots": 4})`.
        (pydantic-settings reads the environment again while it validates, but every field is given here, so nothing
        of it is taken.)"""
        data = self.model_dump()
        for group, changes in groups.items():
            data[group] = {**data[group], **changes}
        return type(self).model_validate(data)
