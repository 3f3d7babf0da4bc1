"""Serving: the batching engine, its memory pools and caches, and the on-device kernel self-check."""
