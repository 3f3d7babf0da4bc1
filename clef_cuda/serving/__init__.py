"""Running requests: the batching engine (engine.py: queue, continuous batching, chunked prefill), its memory pools
and caches (cache.py) and the memory plan that sizes them (plan.py)."""
