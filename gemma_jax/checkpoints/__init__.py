"""Checkpoint formats the library reads and writes, and the error they raise."""


class CheckpointError(ValueError):
  """A checkpoint cannot be read or written as asked: its files do not fit the model its
  config describes, or its destination is not ours to replace."""
