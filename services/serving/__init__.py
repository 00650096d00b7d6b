"""Ray Serve: the app builder, its config, the engine replica, drain, metrics, the launcher.

The only package that imports ``ray.serve``; it joins ``api`` (HTTP) to ``engine``.
"""
