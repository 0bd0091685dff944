"""Routing requests over engine replicas: the cache-aware choice and the per-replica prefix index."""
