"""Speculative decoding, independent of Redis: drafters (model, n-gram; plugin kinds through
workers/plugins.py), adaptive draft length, verification (greedy and rejection sampling), sampling warps
and seeds, stop strings."""
