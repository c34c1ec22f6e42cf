"""What a configured run costs, counted from its config before anything is built. Pure.

    dynmo.estimate.flops    each placement unit's multiply-adds per token (stdlib only): the
                            starting layouts, MFU, the experts' share of a layer's time
    dynmo.estimate.memory   what the fullest rank holds at its peak (the balancer's memory
                            model from the config): the pre-flight check of `dynmo train`

This face imports neither, so the foundations can read `flops` without the memory model's
dependencies.
"""
