"""The head role. Its core: the runtime (tokenizer, lower shard, drafter; `generate`), the step loop and one
generation's state, the batcher that runs a group's rounds as one forward, the relay I/O threads and the beacon (its
liveness key and reply stream). Its job room, `jobs/`: the RQ worker (allow-listed job function, heartbeats, scheduler
thread) and the job function with progress and checkpoints; the core never imports it."""
