"""The torch.distributed runtime: pipeline stages, migration, checkpoints, metrics.

Depends on the pure layers, dynmo.model and dynmo.data; the dynamic-model cases see it only
through `dynmo.runtime.host.PipelineHost`. Nothing below it imports it.
"""
