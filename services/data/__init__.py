"""Prompt sets (benchmark categories, ShareGPT) and the drafter's training data."""
