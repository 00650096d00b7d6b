"""Benchmarks (speed only; tests never time anything)."""
