"""The step: the spec of a stack of transforms, the engine that runs one update, the
micro-batch loop, the user's gradient transforms in order, and the checks before a state
changes. Imports the core only."""
