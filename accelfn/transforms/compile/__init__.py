"""compiled: torch.compile of the model (whole, or its repeated blocks), of the optimizer step on
request, and its compiled code kept in a file that survives restarts."""

from .transform import compiled

__all__ = ["compiled"]
