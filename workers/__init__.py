"""ShardFlow workers: shard loading, drafters, the head loop and the tail loop."""
