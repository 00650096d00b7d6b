"""The engine: requests, scheduler, the draft -> verify -> commit round, its asyncio front.

Imports ``target_actor`` and ``drafter_actor`` (the actors it drives), nothing above it.
"""
