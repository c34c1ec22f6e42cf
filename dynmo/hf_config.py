"""A Hugging Face checkpoint folder as a dynmo model: config.json -> `[model]`, checked before work.

    hf_config.apply(cfg)   # called first thing by dynmo.checks.validate

With `model.hf_path` set, the architecture fields of `cfg.model` are overwritten from the
folder's config.json, and everything dynmo would otherwise compute differently from
transformers is refused with one line naming the field: an unsupported model_type, scaled
rope, an activation other than SiLU, a sliding window shorter than `model.seq_len`, biases
dynmo's layers lack. The safetensors headers are read (names and shapes only, never the
data) and must hold exactly the tensors the resolved model needs, and each file must be as long
as its header says (`read_header` applies the rules safetensors applies when a rank opens the
file, so a truncated copy is refused here and not by every rank after launch); the folder's
tokenizer.json must fit in the embedding. All of this is stdlib: the launcher runs it before
torchrun starts, and every rank runs it again, so every rank resolves the same model.

The name mapping (`hf_names`) lives here too, so the checks, the loader (`dynmo.model.hf`) and
the exporter agree on one table.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from dynmo.config import Config, ConfigError, ModelConfig

# model_type -> (model.family, model.block)
SUPPORTED = {"llama": ("llama", "dense"), "mistral": ("llama", "dense"), "qwen2": ("llama", "dense"),
             "mixtral": ("mixtral", "moe")}
# rms_norm_eps when config.json leaves it out: each transformers config class's own default
DEFAULT_EPS = {"llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6, "mixtral": 1e-5}
EXPERTS = "block_sparse_moe.experts."  # dynmo's stacked expert parameters: <EXPERTS>w1, w2, w3
# Tensors older checkpoints carry that dynmo recomputes instead of storing.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# With tie_word_embeddings the head reads the embedding's tensor: dynmo's head parameter
# TIED_HEAD maps to TIED_EMBEDDING, and a stale lm_head.weight on disk is unused (transformers
# ties it to the embedding on load, too).
TIED_EMBEDDING, TIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
# Bytes per element of the safetensors dtypes: safetensors refuses a file in which a tensor's
# byte range is not exactly its dtype x shape.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
HEADER_LIMIT = 100_000_000  # the largest header safetensors reads (its MAX_HEADER_SIZE)
COPY_AGAIN = "copy it again from the checkpoint's source"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def apply(cfg: Config) -> None:
    """Resolve `cfg.model` from `model.hf_path` (if set) and refuse what dynmo does not implement."""
    m = cfg.model
    if not m.hf_path:
        return
    folder = Path(m.hf_path).expanduser().resolve()
    m.hf_path = str(folder)  # absolute, so the run's config.toml still finds it from another folder
    resolve(m, read_config(folder))
    check_weights(m, folder)
    check_tokenizer(m, folder)


def read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise ConfigError(f"model.hf_path={str(folder)!r} is not a folder; give a Hugging Face checkpoint folder "
                          "(config.json, *.safetensors, tokenizer.json) on this machine (dynmo never downloads)")
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.hf_path: {folder} has no config.json; give the folder save_pretrained wrote")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid JSON ({e}); give the folder save_pretrained wrote") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return hf


def _field(hf: dict, where: Path, name: str, default=None, kind=int):
    value = hf.get(name, default)
    if value is None:
        raise ConfigError(f"{where}: {name} is missing; a {hf.get('model_type')} config.json needs it")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{where}: {name}={value!r} must be a positive integer")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{where}: {name}={value!r} must be a number")
    return kind(value)


def _rope(hf: dict, where: Path) -> float:
    """rope_theta, from transformers 5's `rope_parameters` or the older top-level field."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: rope_parameters={params!r} is not an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"{where}: rope_type {kind!r} (rope_parameters / rope_scaling): dynmo implements only "
                          "the default rotary embedding; use a checkpoint without rope scaling")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor={params['partial_rotary_factor']}: dynmo rotates the "
                          "whole head; use a checkpoint with full rotary embeddings")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta={theta!r} must be a positive number")
    return float(theta)


def resolve(m: ModelConfig, hf: dict, where: Path | None = None) -> None:
    """Overwrite the architecture fields of `m` from a config.json dict; ConfigError if unsupported."""
    where = where or Path(m.hf_path) / "config.json"
    mt = hf.get("model_type")
    if mt not in SUPPORTED:
        raise ConfigError(f"{where}: model_type {mt!r} is not supported; dynmo implements "
                          f"{', '.join(SUPPORTED)} (model.hf_path)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r}: dynmo's SwiGLU MLP uses silu; use a silu checkpoint")
    if mt in ("llama", "mistral") and hf.get("attention_bias", False):
        raise ConfigError(f"{where}: attention_bias = true gives {mt} an o_proj bias dynmo's attention lacks; "
                          "use a checkpoint without attention biases")
    if hf.get("mlp_bias", False):
        raise ConfigError(f"{where}: mlp_bias = true: dynmo's MLP has no biases; use a checkpoint without them")
    if hf.get("attention_dropout", 0.0):
        raise ConfigError(f"{where}: attention_dropout={hf['attention_dropout']}: dynmo's {SUPPORTED[mt][0]} "
                          "family has no dropout; set attention_dropout to 0.0 in config.json")
    if hf.get("router_jitter_noise", 0.0):
        raise ConfigError(f"{where}: router_jitter_noise={hf['router_jitter_noise']}: dynmo's router adds no "
                          "noise; set router_jitter_noise to 0.0 in config.json")
    window = hf.get("sliding_window")
    sliding = window is not None and (mt != "qwen2" or hf.get("use_sliding_window", False)
                                      or "sliding_attention" in (hf.get("layer_types") or []))
    if sliding and window < m.seq_len:
        raise ConfigError(f"{where}: sliding_window={window} is shorter than model.seq_len={m.seq_len}, and "
                          f"dynmo's attention is full causal; use model.seq_len <= {window}")
    max_pos = hf.get("max_position_embeddings")
    if isinstance(max_pos, int) and m.seq_len > max_pos:
        raise ConfigError(f"model.seq_len={m.seq_len} exceeds max_position_embeddings={max_pos} of {where}; "
                          f"use model.seq_len <= {max_pos}")
    m.family, m.block = SUPPORTED[mt]
    m.d_model = _field(hf, where, "hidden_size")
    m.n_heads = _field(hf, where, "num_attention_heads")
    m.n_kv_heads = _field(hf, where, "num_key_value_heads", m.n_heads)
    m.n_layers = _field(hf, where, "num_hidden_layers")
    m.intermediate_size = _field(hf, where, "intermediate_size")
    m.vocab_size = _field(hf, where, "vocab_size")
    m.head_dim = 0 if hf.get("head_dim") is None else _field(hf, where, "head_dim")
    m.norm_eps = _field(hf, where, "rms_norm_eps", DEFAULT_EPS[mt], float)
    m.rope_theta = _rope(hf, where)
    m.attention_bias = mt == "qwen2"  # Qwen2 always has q/k/v biases (and none on o_proj)
    tied = hf.get("tie_word_embeddings")
    tied = False if tied is None else tied  # transformers' default for these model types
    if not isinstance(tied, bool):
        raise ConfigError(f"{where}: tie_word_embeddings={tied!r} must be true or false")
    m.tie_embeddings = tied
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"{where}: num_attention_heads={m.n_heads} is not a multiple of "
                          f"num_key_value_heads={m.n_kv_heads}")
    if not m.head_dim and m.d_model % m.n_heads:
        raise ConfigError(f"{where}: hidden_size={m.d_model} is not divisible by num_attention_heads={m.n_heads} "
                          "and head_dim is not given")
    if mt == "mixtral":
        m.moe.num_experts = _field(hf, where, "num_local_experts", 8)
        m.moe.top_k = _field(hf, where, "num_experts_per_tok", 2)
        m.moe.aux_loss_coef = _field(hf, where, "router_aux_loss_coef", 0.001, float)
        m.moe.norm_topk_prob = True  # Mixtral always renormalises the top-k probabilities


# ---- names ---------------------------------------------------------------------------------
def hf_names(letter: str, block: int | None, pname: str, num_experts: int, tied: bool = False) -> list[str]:
    """Hugging Face tensor names of parameter `pname` of a dynmo layer ("E", "t" + block number, "L").

    A stacked expert parameter (`block_sparse_moe.experts.w1`, [experts, ...]) has one name per
    expert, in expert order; every other parameter has exactly one. With `tied`
    (tie_word_embeddings) the head's `lm_head.weight` is the embedding's tensor.
    """
    if letter == "E":
        return [f"model.{pname}"]
    if letter == "L":
        if tied and pname == TIED_HEAD:
            return [TIED_EMBEDDING]
        return [pname if pname.startswith("lm_head.") else f"model.{pname}"]
    prefix = f"model.layers.{block}."
    if pname.startswith(EXPERTS):
        w = pname[len(EXPERTS):]
        return [f"{prefix}{EXPERTS}{j}.{w}.weight" for j in range(num_experts)]
    return [prefix + pname]


def unused(name: str, m: ModelConfig) -> bool:
    """A checkpoint tensor dynmo does not load: one it recomputes, or a tied model's lm_head.weight."""
    return name.endswith(IGNORED_SUFFIXES) or (m.tie_embeddings and name == TIED_HEAD)


def layer_prefixes(letter: str, block: int | None) -> tuple[str, ...]:
    """Name prefixes of every Hugging Face tensor that belongs to this dynmo layer."""
    if letter == "E":
        return ("model.embed_tokens.",)
    if letter == "L":
        return ("model.norm.", "lm_head.")
    return (f"model.layers.{block}.",)


def param_shapes(m: ModelConfig) -> list[tuple[str, int | None, dict[str, tuple[int, ...]]]]:
    """(letter, block, {dynmo parameter: shape}) per layer of the resolved model, without torch.

    The same shapes the classes of dynmo.model.llama / mixtral allocate (tests compare them).
    """
    D, V, H = m.d_model, m.vocab_size, m.n_heads
    KV, hd = m.n_kv_heads or H, m.head_dim or m.d_model // H
    inter = m.intermediate_size or m.mlp_ratio * D
    block: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
        "self_attn.q_proj.weight": (H * hd, D), "self_attn.k_proj.weight": (KV * hd, D),
        "self_attn.v_proj.weight": (KV * hd, D), "self_attn.o_proj.weight": (D, H * hd),
    }
    if m.attention_bias:
        block |= {"self_attn.q_proj.bias": (H * hd,), "self_attn.k_proj.bias": (KV * hd,),
                  "self_attn.v_proj.bias": (KV * hd,)}
    if m.family == "mixtral":
        E = m.moe.num_experts
        block |= {"block_sparse_moe.gate.weight": (E, D), EXPERTS + "w1": (E, inter, D),
                  EXPERTS + "w2": (E, D, inter), EXPERTS + "w3": (E, inter, D)}
    else:
        block |= {"mlp.gate_proj.weight": (inter, D), "mlp.up_proj.weight": (inter, D),
                  "mlp.down_proj.weight": (D, inter)}
    return ([("E", None, {"embed_tokens.weight": (V, D)})]
            + [("t", b, dict(block)) for b in range(m.n_layers)]
            + [("L", None, {"norm.weight": (D,), "lm_head.weight": (V, D)})])


def expected_tensors(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor a checkpoint of this model holds (a tied model:
    no lm_head.weight)."""
    out: dict[str, tuple[int, ...]] = {}
    for letter, block, params in param_shapes(m):
        for pname, shape in params.items():
            for name in hf_names(letter, block, pname, m.moe.num_experts, m.tie_embeddings):
                out[name] = shape[1:] if pname.startswith(EXPERTS) else shape
    return out


# ---- the weight files ----------------------------------------------------------------------
def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index of a sharded checkpoint or its one file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{index}: not a safetensors index (no weight_map)") from None
        files = {name: folder / f for name, f in weight_map.items()}
        missing = sorted({str(p) for p in files.values() if not p.is_file()})
        if missing:
            raise ConfigError(f"{index} lists {missing[0]}, which does not exist; copy the whole checkpoint folder")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return {name: single for name in read_header(single)}
    other = "pytorch_model.bin" if any(folder.glob("pytorch_model*.bin")) else ""
    hint = (f"it has only {other}: convert it (transformers: from_pretrained, then save_pretrained)" if other
            else "copy the checkpoint's *.safetensors files into it")
    raise ConfigError(f"model.hf_path: {folder} has no model.safetensors or model.safetensors.index.json; {hint}")


def read_header(path: Path) -> dict[str, dict]:
    """The JSON header of a safetensors file: name -> {dtype, shape, data_offsets}.

    Checked as safetensors checks it when a rank opens the file (8-byte little-endian length,
    a JSON object, tensors packed back to back, the file exactly as long as they need), so a
    copy cut short is refused before launch, naming the file, instead of failing on every rank.
    Reads the header only, never the tensors."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > HEADER_LIMIT:
                raise ValueError
            text = f.read(n)
        if len(text) < n:
            raise EOFError
        header = json.loads(text)
        if not isinstance(header, dict):
            raise ValueError
    except EOFError:
        raise ConfigError(f"{path} is truncated: it ends inside its header ({size} bytes); {COPY_AGAIN}") from None
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        raise ConfigError(f"{path} is not a readable safetensors file; {COPY_AGAIN}") from None
    header.pop("__metadata__", None)
    have, need = size - 8 - n, _data_end(path, header)
    if need > have:
        raise ConfigError(f"{path} is truncated: its header places {need} bytes of tensors after it, the file "
                          f"holds {have} ({size} bytes in all); {COPY_AGAIN}")
    if need < have:
        raise ConfigError(f"{path} has {have - need} bytes after its last tensor, which safetensors refuses "
                          f"(a damaged or appended-to file); {COPY_AGAIN}")
    return header


def _data_end(path: Path, header: dict) -> int:
    """Where the tensors' bytes end, after checking each entry: offsets that are whole numbers,
    tensors packed back to back in offset order from 0, each exactly as long as its dtype and
    shape need (dtypes this table does not know are left to the dtype check)."""
    spans = []
    for name, info in header.items():
        try:
            (start, end), shape, dtype = info["data_offsets"], info["shape"], info["dtype"]
            if not all(type(x) is int and x >= 0 for x in (start, end, *shape)):
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise ConfigError(f"{path}: the header entry of {name} is malformed; {COPY_AGAIN}") from None
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype] if dtype in DTYPE_BYTES else None
        spans.append((start, end, name, nbytes))
    pos = 0
    for start, end, name, nbytes in sorted(spans, key=lambda s: s[:3]):
        if start != pos or end < start:
            raise ConfigError(f"{path}: the bytes of {name} ({start}..{end}) do not follow the tensor before it "
                              f"(which ends at {pos}); {COPY_AGAIN}")
        if nbytes is not None and end - start != nbytes:
            raise ConfigError(f"{path}: {name} takes {end - start} bytes, its dtype and shape need {nbytes}; "
                              f"{COPY_AGAIN}")
        pos = end
    return pos


def check_weights(m: ModelConfig, folder: Path) -> None:
    """The checkpoint holds exactly the tensors of the resolved model, in a float dtype."""
    files = weight_files(folder)
    headers = {path: read_header(path) for path in sorted(set(files.values()))}
    misplaced = [(name, path) for name, path in files.items() if name not in headers[path]]
    if misplaced:
        name, path = misplaced[0]
        raise ConfigError(f"{folder / 'model.safetensors.index.json'} places {name} in {path.name}, which does not "
                          "hold it; copy the whole checkpoint folder again")
    found: dict[str, dict] = {}
    for header in headers.values():
        found |= header
    want = expected_tensors(m)
    missing = [n for n in want if n not in found]
    if missing:
        raise ConfigError(f"{folder}: the safetensors lack {len(missing)} tensors the {m.family} model of "
                          f"config.json needs, first {missing[0]}; copy the whole checkpoint folder")
    extra = [n for n in found if n not in want and not unused(n, m)]
    if extra:
        raise ConfigError(f"{folder}: {len(extra)} tensors dynmo's {m.family} layers do not have, first {extra[0]} "
                          "(a variant dynmo does not implement)")
    for name, shape in want.items():
        info = found[name]
        if tuple(info["shape"]) != shape:
            raise ConfigError(f"{folder}: {name} has shape {info['shape']}, config.json implies {list(shape)}")
        if info["dtype"] not in FLOAT_DTYPES:
            raise ConfigError(f"{folder}: {name} is {info['dtype']}; dynmo loads float weights "
                              "(F32, BF16, F16), not quantized ones")


# ---- the tokenizer -------------------------------------------------------------------------
def tokenizer_size(path: Path) -> int:
    """Highest token id + 1 of a tokenizers `tokenizer.json` (vocabulary and added tokens)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = (data.get("model") or {}).get("vocab") or {}
        ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]  # Unigram: a list
        ids += [t["id"] for t in data.get("added_tokens") or []]
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError):
        raise ConfigError(f"{path} is not a tokenizers tokenizer.json") from None
    return max(ids, default=-1) + 1


def check_tokenizer(m: ModelConfig, folder: Path) -> None:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"model.hf_path: {folder} has no tokenizer.json, which dynmo tokenizes the data with; "
                          "write one with transformers (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))")
    size = tokenizer_size(path)
    if size > m.vocab_size:
        raise ConfigError(f"{path} has {size} tokens but the model's vocab_size is {m.vocab_size} (config.json): "
                          "its ids would index past the embedding; use the tokenizer of this checkpoint")
