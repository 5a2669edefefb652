"""Memory measurement: live/peak tensor bytes (CPU dispatch tracking, CUDA allocator)."""
