"""ShardFlow's user side: the `shardflow` command line and Python client."""
