"""ShardFlow's benchmarks: the maintained measurements behind docs/benchmarks.md, run from the repo root as
`python -m bench.<script>` (each script's docstring says how). The product never imports this package, and it and
the tests never import each other (the import-linter contracts in pyproject.toml).

Entry points:
- `jobs`: the job path end to end (embedded Redis, real `shardflow tail`, `shardflow stage` and `shardflow head`
  processes, N jobs through the producer `Client`): aggregate, steady-state and per-job tokens/s, latency, time to
  first token, where a round goes, GPU busy, memory, greedy outputs checked. Its parts: `jobs_models` (target,
  prompts, references), `jobs_requests` (each job's request), `jobs_workers` (worker processes, middle stages, a
  batch), `jobs_report` (the figures), `jobs_tables` (jobs.json / jobs.md / jobs.png), `jobs_accounting` (where a
  round goes), `jobs_waves` (steady state, slot gaps), `jobs_singles` (the N=1 row), `usage` (GPU and thread
  sampling), `link` (the emulated link between each worker and Redis: bandwidth on one shared wire, delay, jitter,
  stalls, named profiles; also runs alone);
- `stages`: one group's draft, head and tail alone at B sequences against the floor (`stages_floor`), with the top
  kernels of a stage (`--profile`);
- `gpu_parity`: greedy parity with HF `generate` on a GPU with CUDA graphs (dtypes, quantized shards);
- `soak`: 10,000 tiny jobs, none lost, Redis memory back to where it started;
- `memory`: what a shard load holds (parameters, peak RSS) for layers [a, b) of a checkpoint;
- `mac_cost`: what sealing and checking rounds' MACs costs a head's sender and a tail (docs/security.md, "Sessions
  are authenticated");
- `codec`: the lossless wire codec (schemas/codec.py) on SmolLM2's real hidden states: bytes saved, encode and decode
  speed, against plain zstd and lz4;
- `round_spread`: the rounds a batch's slowest job needs at a given acceptance, and the tokens/s bound it sets.

`synthetic` is the benchmark worker plugin (`--plugin bench.synthetic`: the synthetic drafter, `random:<preset>`
targets). `device.sh` runs the GPU figures' device calls (`bash bench/device.sh PART[:SECONDS] ...`: jobs,
families, gemma4, ab, stages, qparity, card7, card14, plan); `device_env.sh` is what it sources on the device.
"""
