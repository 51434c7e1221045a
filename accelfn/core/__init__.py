"""The core: the step protocol, the engine, TrainState, batches, module utilities, torch compat.

Imports nothing else of accelfn; every other package imports it.
"""
