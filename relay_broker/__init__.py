"""The Redis side of ShardFlow: connections, stream names, publish/consume/ack, embedded Redis."""
