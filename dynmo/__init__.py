"""dynmo: balanced and elastic pipeline-parallel training of dynamic transformer LMs.

Architecture (imports only flow downwards):

    dynmo.layout, dynmo.balance, dynmo.sim      pure algorithms, no torch, no runtime
    dynmo.model, dynmo.data, dynmo.config       model, data and configuration
    dynmo.runtime                               torch.distributed pipeline runtime
    dynmo.cli, dynmo.train                      entry points
"""

__version__ = "0.1.0"
