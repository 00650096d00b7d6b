from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the session (4 logical CPUs so TP=3 + a driver fit on 2 cores)."""
    import ray

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        ignore_reinit_error=True,
    )
    yield ray
    ray.shutdown()
