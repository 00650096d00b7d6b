"""Adaptive speculation: the per-round draft length and engine-side context copies."""
