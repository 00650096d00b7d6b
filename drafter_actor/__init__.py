"""drafter_actor package."""
