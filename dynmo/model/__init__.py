"""The model as a sequence of pipeline-movable layers: E (embedding), t (blocks), L (head)."""

from dynmo.model.gpt import Block, Embedding, Head, LayerSpec, build_layer, layer_specs, loss_fn

__all__ = ["Block", "Embedding", "Head", "LayerSpec", "build_layer", "layer_specs", "loss_fn"]
