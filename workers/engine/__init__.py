"""Model execution: load a shard's layers (`shard`), run them as one batched forward with KV caches that
roll back (`kvcache`) through the lean fused layers (`fused`) or the HF ones (`attention`), and replay
CUDA graphs (`runner`: the `Engine` every role runs its models with)."""
