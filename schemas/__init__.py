"""Every wire and storage shape of ShardFlow as pydantic models, plus the one tensor codec."""
