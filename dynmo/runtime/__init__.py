"""The torch.distributed runtime: pipeline stages, migration, checkpoints, metrics.

Depends on dynmo.layout / dynmo.model / dynmo.data; nothing pure depends on it.
"""
