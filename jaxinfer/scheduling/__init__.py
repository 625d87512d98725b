"""The host side: requests, step plans, bucket tables, the block pool and KV manager, the queue, the scheduler,
the run loop, grammar guides, stopping, replica routing and replayed arrivals. Plain Python and numpy: nothing under this folder
imports jax (tests/test_layers.py checks it by path)."""
