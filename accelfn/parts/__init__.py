"""The built-ins' mechanisms, one module per built-in: a frozen options dataclass (validated
when built, its repr the label the stack prints) and the plain functions the engine calls by
name at the built-in's place in the update (``clipping.clip(options, ctx)``). Imports the
core only; builds no step (the public constructors in ``accelfn.transforms`` do)."""
