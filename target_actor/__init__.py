"""target_actor package."""
