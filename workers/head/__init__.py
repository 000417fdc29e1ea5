"""The head role: its runtime (tokenizer, lower shard, drafter; `generate`), one generation's round loop,
the batcher that runs every in-flight generation's round as one forward, the RQ worker (allow-listed job
function, heartbeats, scheduler thread) and the job function with progress and checkpoints."""
