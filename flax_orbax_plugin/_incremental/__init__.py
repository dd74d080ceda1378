"""Incremental steps: digests, reuse plan, links, server-side copies."""
