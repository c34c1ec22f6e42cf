"""Hugging Face safetensors <-> dynmo layers: read one layer's tensors by name, write them back.

    with HFReader(cfg.model.hf_path) as reader:
        for spec in my_specs:
            layer = empty_layer(spec, cfg.model, device)
            load_layer(layer, spec, cfg.model, reader)

A rank reads only the tensors of the layers it builds: `HFReader` opens the files lazily with
`safetensors.safe_open` (memory-mapped) and reads tensor by tensor, counting what it read, so a
pipeline stage never pulls a whole multi-gigabyte checkpoint. The name table is
`dynmo.hf_config.hf_names` (pure, shared with the checks and the exporter); the Mixtral
experts, one tensor per expert on disk, are stacked per projection in dynmo. A tied model
(`tie_word_embeddings`) has no `lm_head.weight`: the head reads, and the export writes, the
embedding's `model.embed_tokens.weight`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from dynmo.config import ModelConfig
from dynmo.hf_config import COPY_AGAIN, EXPERTS, TIED_HEAD, hf_names, layer_prefixes, unused
from dynmo.model.layers import LayerSpec


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint does not fit the dynmo layer it should fill."""


def _unreadable(path: Path, e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return f"{path} cannot be read as safetensors ({first}); {COPY_AGAIN}"


class HFReader:
    """Tensors of a Hugging Face checkpoint folder by name, from `model.safetensors` or the shards
    a `model.safetensors.index.json` lists. `names_read` and `bytes_read` count what was read.

    A file safetensors cannot read (damaged after the checks before launch passed) is an
    HFCheckpointError naming it, never safetensors' own error."""

    def __init__(self, folder: str | Path):
        from safetensors import SafetensorError, safe_open

        self.folder = Path(folder)
        self._open = safe_open
        self._errors = (SafetensorError, OSError)
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError):
                raise HFCheckpointError(f"{index} is not a safetensors index (no weight_map); {COPY_AGAIN}") from None
            self._file = {name: self.folder / f for name, f in weight_map.items()}
        elif single.is_file():
            self._file = {name: single for name in self._opened(single).keys()}
        else:
            raise HFCheckpointError(f"{self.folder} has no model.safetensors or model.safetensors.index.json")
        self._handles: dict[Path, object] = {}
        self.names_read: list[str] = []
        self.bytes_read = 0

    def __enter__(self) -> "HFReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()  # safe_open handles unmap when dropped

    def keys(self) -> list[str]:
        return list(self._file)

    def __contains__(self, name: str) -> bool:
        return name in self._file

    def _opened(self, path: Path):
        try:
            return self._open(str(path), framework="pt")
        except self._errors as e:
            raise HFCheckpointError(_unreadable(path, e)) from None

    def _handle(self, name: str):
        path = self._file[name]
        if path not in self._handles:
            self._handles[path] = self._opened(path)
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the file's header, without reading the data."""
        try:
            return tuple(self._handle(name).get_slice(name).get_shape())
        except self._errors as e:
            raise HFCheckpointError(_unreadable(self._file[name], e)) from None

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file:
            raise HFCheckpointError(f"{self.folder}: no tensor {name}")
        try:
            t = self._handle(name).get_tensor(name)
        except self._errors as e:
            raise HFCheckpointError(_unreadable(self._file[name], e)) from None
        self.names_read.append(name)
        self.bytes_read += t.numel() * t.element_size()
        return t


def load_layer(layer: nn.Module, spec: LayerSpec, cfg: ModelConfig, reader: HFReader) -> list[str]:
    """Copy the checkpoint's tensors of layer `spec` into `layer`'s parameters, in place.

    Strict both ways: every parameter must find its tensor(s) with the right shape, and every
    checkpoint tensor of this layer must land in a parameter. Returns the names read.
    """
    letter, block = spec.letter, spec.block
    used: list[str] = []
    with torch.no_grad():
        for pname, p in layer.named_parameters():
            names = hf_names(letter, block, pname, cfg.moe.num_experts, cfg.tie_embeddings)
            stacked = pname.startswith(EXPERTS)
            if stacked and len(names) != p.shape[0]:
                raise HFCheckpointError(f"{spec.name}.{pname} stacks {p.shape[0]} experts, the config has "
                                        f"{len(names)} (model.moe.num_experts)")
            for j, name in enumerate(names):
                if name not in reader:
                    raise HFCheckpointError(f"{reader.folder}: no tensor {name} for dynmo's {spec.name}.{pname}")
                want = tuple(p.shape[1:] if stacked else p.shape)
                have = reader.shape(name)
                if have != want:
                    raise HFCheckpointError(f"{reader.folder}: {name} has shape {list(have)}, dynmo's "
                                            f"{spec.name}.{pname} needs {list(want)}")
                (p[j] if stacked else p).copy_(reader.get(name))
                used.append(name)
    prefixes = layer_prefixes(letter, block)
    if spec.part:  # a half block: the tensors of its own modules (dynmo names them as the checkpoint does)
        own = type(layer).halves[0 if spec.part == "attn" else 1]
        prefixes = tuple(f"{p}{name}." for p in prefixes for name in own)
    mine = set(used)
    extra = [n for n in reader.keys()
             if n.startswith(prefixes) and n not in mine and not unused(n, cfg)]
    if extra:
        raise HFCheckpointError(f"{reader.folder}: {extra[0]} (and {len(extra) - 1} more) have no place in dynmo's "
                                f"{spec.name}; the checkpoint is a variant dynmo does not implement")
    return used


def to_hf(spec: LayerSpec, pname: str, tensor: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face name -> tensor for one dynmo parameter; stacked experts split into one per expert.
    Nothing for the head's copy of a tied embedding: the embedding's tensor stands for both."""
    if cfg.tie_embeddings and spec.letter == "L" and pname == TIED_HEAD:
        return {}
    names = hf_names(spec.letter, spec.block, pname, cfg.moe.num_experts)
    if pname.startswith(EXPERTS):
        if tensor.shape[0] != len(names):
            raise HFCheckpointError(f"{spec.name}.{pname} stacks {tensor.shape[0]} experts, "
                                    f"the config has {len(names)}")
        # clones: safetensors refuses tensors that share storage
        return {name: tensor[j].clone() for j, name in enumerate(names)}
    return {names[0]: tensor}


def hf_state_dict(layers: dict[int, nn.Module], specs: list[LayerSpec], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of in-memory dynmo layers (index -> layer)."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in layers.items():
        for pname, p in layer.named_parameters():
            out |= to_hf(specs[i], pname, p.detach(), cfg)
    return out


def hf_config_dict(cfg: ModelConfig, base: dict | None = None) -> dict:
    """config.json of the exported model. `base` (the source checkpoint's config.json, if any) lends
    what dynmo does not track: token ids, max_position_embeddings."""
    if cfg.family not in ("llama", "mixtral"):
        raise HFCheckpointError(f"model.family={cfg.family!r} has no Hugging Face counterpart; "
                                "only llama and mixtral models export")
    base = base or {}
    # Llama's attention_bias also puts a bias on o_proj; Qwen2 is the model with q/k/v biases only.
    if cfg.family == "mixtral":
        mt, arch = "mixtral", "MixtralForCausalLM"
    elif cfg.attention_bias:
        mt, arch = "qwen2", "Qwen2ForCausalLM"
    else:
        mt, arch = "llama", "LlamaForCausalLM"
    hd = cfg.head_dim or cfg.d_model // cfg.n_heads
    out = {
        "architectures": [arch],
        "model_type": mt,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.intermediate_size or cfg.mlp_ratio * cfg.d_model,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
        "num_hidden_layers": cfg.n_layers,
        "head_dim": hd,
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": max(int(base.get("max_position_embeddings") or 0), cfg.seq_len),
        "rms_norm_eps": cfg.norm_eps,
        # both spellings: transformers 5 reads rope_parameters, older versions the top-level field
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in base:
            out[key] = base[key]
    if mt == "llama":
        out |= {"attention_bias": False, "mlp_bias": False}
    if mt == "qwen2":
        out |= {"use_sliding_window": False, "sliding_window": None}
    if mt == "mixtral":
        if not cfg.moe.norm_topk_prob:
            raise HFCheckpointError("model.moe.norm_topk_prob = false routes differently from Hugging Face's "
                                    "Mixtral, which always renormalises; this model cannot export as mixtral")
        out |= {"num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k,
                "router_aux_loss_coef": cfg.moe.aux_loss_coef, "router_jitter_noise": 0.0,
                "output_router_logits": False, "sliding_window": None}
    return out
