"""accelfn: composable transforms over a pure PyTorch step function."""
