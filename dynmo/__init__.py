"""dynmo: balanced and elastic pipeline-parallel training of dynamic transformer LMs.

The package is a stack of layers; a module imports only from its own layer or lower ones
(docs/architecture.md has the table, tests/test_architecture.py checks it):

    dynmo.config, .layout, .schedules, .record      foundations (stdlib only)
    dynmo.balance                                   balancers (numpy)
    dynmo.controller, .loop, .plan                  the DynMo loop's decisions (pure)
    dynmo.sim                                       simulator and trace replay (pure)
    dynmo.data, dynmo.model                         tokens and the model (torch)
    dynmo.dynamics                                  dynamic-model cases
    dynmo.runtime                                   the torch.distributed pipeline runtime
    dynmo.checks, .train, .launch, .bench, .cli     entry points
"""

__version__ = "0.1.0"
