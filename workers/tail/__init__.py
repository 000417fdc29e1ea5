"""The tail role: the serve loop (read rounds through a consumer group, verify, reply, dead-letter) and
the per-session KV caches it holds."""
