"""The core, the ground every layer stands on: TrainState, batches, the call contexts,
optimizers, processes, module utilities and torch compat (every private torch API behind one
name).

Imports nothing else of accelfn; every other package imports it.
"""
