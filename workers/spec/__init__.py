"""Speculative decoding, independent of Redis: drafters (model, n-gram, synthetic), adaptive draft
length, verification (greedy and rejection sampling), sampling warps and seeds, stop strings."""
