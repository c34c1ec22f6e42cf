"""The files a configuration names: the Hugging Face weights it loads, the run folder and trace it
writes, the text it trains on, and the checkpoint it resumes from (a complete dynmo.json, the
same model, the cases its state needs).

Part of `dynmo.checks` (validation before any process starts): `check_checkpoint` is what
`checkpoint.resume` must pass, before launch and again on every rank. Import-light, no torch
(DCP's own metadata is read by `dynmo.runtime.safeload`, imported when a checkpoint is checked).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

from dynmo import hf_config
from dynmo.checks.values import fmt
from dynmo.config import Config, ConfigError, ModelConfig
from dynmo.layout import Layout
from dynmo.plan import layer_names, num_layers

MODEL_SHAPE_FIELDS = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio", "tie_embeddings")
# what a checkpoint's dynmo.json must hold: key -> (accepts the value, what it should be)
CHECKPOINT_KEYS = {
    "step": (lambda v: type(v) is int and v >= 0, "a step number >= 0"),
    "model": (lambda v: isinstance(v, dict), "the [model] section (an object)"),
    "layer_names": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of layer names"),
    "layout": (lambda v: isinstance(v, list) and all(type(x) is int for x in v), "a list of stage boundaries"),
}


def read_checkpoint_meta(path: str) -> dict:
    """The checkpoint folder's dynmo.json, checked to hold what a resume reads."""
    meta_path = Path(path) / "dynmo.json"
    if not meta_path.is_file():
        raise ConfigError(f"checkpoint.resume={path!r} is not a dynmo checkpoint (no dynmo.json inside)")
    damaged = "the checkpoint is incomplete or damaged; resume from another checkpoint"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON (JSONDecodeError is a ValueError)
        raise ConfigError(f"{meta_path} is not valid JSON ({e}); {damaged}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{meta_path} holds a JSON {type(meta).__name__}, not an object; {damaged}")
    missing = [k for k in CHECKPOINT_KEYS if k not in meta]
    if missing:
        raise ConfigError(f"{meta_path} lacks {', '.join(repr(k) for k in missing)}; {damaged}")
    for key, (ok, what) in CHECKPOINT_KEYS.items():
        if not ok(meta[key]):
            shown = repr(meta[key])
            raise ConfigError(f"{meta_path}: {key!r} should be {what}, got {shown[:60] + '...' if len(shown) > 60 else shown}"
                              f"; {damaged}")
    return meta


def _with_defaults(saved: dict, defaults: dict) -> dict:
    """`saved` over `defaults`, section by section: what an older checkpoint lacks takes the default."""
    out = dict(defaults)
    for k, v in saved.items():
        out[k] = _with_defaults(v, defaults[k]) if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
    return out


def model_signature(m: dict) -> dict[str, object]:
    """What decides the set and the shapes of a model's parameters and saved buffers, by field
    name, sizes that 0 derives resolved: `MODEL_SHAPE_FIELDS`, the family and block, the
    llama/mixtral attention and MLP sizes, the MoE expert count, the hash buckets (a buffer)."""
    sig: dict[str, object] = {"family": m["family"], "block": m["block"]}
    sig |= {k: m[k] for k in MODEL_SHAPE_FIELDS}
    if m["family"] != "gpt":  # the GPT's layers ignore these
        heads = m["n_heads"]
        sig["n_kv_heads"] = m["n_kv_heads"] or heads
        sig["head_dim"] = m["head_dim"] or (m["d_model"] // heads if heads else 0)
        sig["intermediate_size"] = m["intermediate_size"] or m["mlp_ratio"] * m["d_model"]
        sig["attention_bias"] = m["attention_bias"]
    if m["block"] == "moe":
        sig["moe.num_experts"] = m["moe"]["num_experts"]
    if m["block"] == "hashattn":
        sig["hashattn.n_buckets"] = m["hashattn"]["n_buckets"]
    return sig


def check_checkpoint(cfg: Config, path: str) -> dict:
    """A checkpoint the config can resume from: a complete dynmo.json, the same model (the
    same parameters with the same shapes, the same layer names), the same dynamic-model cases
    where they add or remove parameters or optimizer state, and a step within train.steps."""
    meta = read_checkpoint_meta(path)
    defaults = dataclasses.asdict(ModelConfig())
    try:
        saved = model_signature(_with_defaults(meta["model"], defaults))  # older checkpoints: defaults
    except (TypeError, KeyError, ValueError, ArithmeticError):
        raise ConfigError(f"{Path(path) / 'dynmo.json'}: its 'model' section is malformed; the checkpoint is "
                          "incomplete or damaged; resume from another checkpoint") from None
    now = model_signature(dataclasses.asdict(cfg.model))
    diffs = [f"model.{k}: checkpoint {fmt(saved[k])} vs config {fmt(now[k])}"
             for k in now if k in saved and saved[k] != now[k]]
    if diffs:
        raise ConfigError(
            "the checkpoint holds a model of a different shape: " + "; ".join(diffs) +
            ". Resume with the checkpoint's model settings (its config.toml is beside it)."
        )
    names, theirs = layer_names(cfg), meta["layer_names"]
    if theirs != names:
        i = next((i for i, (a, b) in enumerate(zip(theirs, names)) if a != b), min(len(theirs), len(names)))
        a = repr(theirs[i]) if i < len(theirs) else "nothing"
        b = repr(names[i]) if i < len(names) else "nothing"
        raise ConfigError(f"{Path(path) / 'dynmo.json'}: the checkpoint's layers are not the model's: layer {i} is {a} "
                          f"in the checkpoint and {b} in the model ({len(theirs)} vs {len(names)} layers)")
    check_checkpoint_cases(cfg, path, meta)
    check_checkpoint_grow(cfg, path, meta)
    check_checkpoint_placement(cfg, path, meta)
    step, steps = meta["step"], cfg.train.steps
    if step > steps:
        raise ConfigError(f"checkpoint {path} is at step {step}, past train.steps={steps}; raise --steps "
                          f"(train.steps) to {step} or more to train on from it")
    # DCP's own metadata, read without running code (a crafted file is refused here, before launch),
    # and the shard files it names, each long enough for the bytes it is said to hold
    from dynmo.runtime.safeload import CheckpointError, check_files

    try:
        check_files(path)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return meta


def check_checkpoint_placement(cfg: Config, path: str, meta: dict) -> None:
    """The experts' placements a checkpoint records (`expert_placement`: {block name: order},
    restored on resume under expert parallelism where they fit its ranks and slots) must hold
    every expert of the model and no other."""
    saved = meta.get("expert_placement") or {}
    n = cfg.model.moe.num_experts
    blocks = {f"block{b}" for b in range(cfg.model.n_layers)}
    ok = isinstance(saved, dict) and all(
        k in blocks and isinstance(v, list) and all(type(e) is int for e in v) and set(v) == set(range(n))
        for k, v in saved.items())
    if not ok:
        raise ConfigError(f"{Path(path) / 'dynmo.json'}: its 'expert_placement' record is not an order of the "
                          f"{n} experts per MoE block; the checkpoint is damaged")


def check_checkpoint_grow(cfg: Config, path: str, meta: dict) -> None:
    """A checkpoint saved for a grow (`dynmo.trainer`) records the layout the run resumes on and
    when the grow was decided and saved; a record that does not hold them is refused."""
    grow = meta.get("grow")
    if grow is None:
        return
    try:
        layout = Layout(tuple(int(b) for b in grow["layout"]))
        ok = (type(grow["step"]) is int and all(type(k) is int for k in grow["stages"]) and len(grow["stages"]) == 2
              and all(isinstance(grow[k], (int, float)) for k in ("decided_at", "saved_at")))
        if meta.get("unit", "block") == cfg.parallel.unit and layout.num_layers != num_layers(cfg):
            ok = False
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{Path(path) / 'dynmo.json'}: its 'grow' record (the layout to resume on after a grow) "
                          "is malformed; the checkpoint is damaged: resume from another checkpoint")


def check_checkpoint_cases(cfg: Config, path: str, meta: dict) -> None:
    """The cases that change the parameters (early exit adds classifiers, structured pruning
    narrows MLPs) or the optimizer state (freezing drops it) must be on to resume their state."""
    cases = meta.get("cases")
    if not isinstance(cases, dict):  # older checkpoints record no cases
        return
    if cfg.early_exit.enabled:
        if "early-exit" not in cases:  # the case's name (dynmo.dynamics.earlyexit.EarlyExit.name)
            raise ConfigError(f"checkpoint {path} was saved without early exit, so its blocks have no exit classifiers; "
                              "resume with early_exit.enabled = false, or start a new run")
        first = _saved_setting(path, "early_exit", "first_block")
        if isinstance(first, int) and cfg.early_exit.first_block < first:
            raise ConfigError(f"checkpoint {path} has exit classifiers from block {first} on; resume with "
                              f"early_exit.first_block >= {first} (got {cfg.early_exit.first_block})")
    freeze, prune = cases.get("freeze"), cases.get("prune")
    frozen = freeze.get("frozen") if isinstance(freeze, dict) else None
    if frozen and not cfg.freeze.enabled:
        names = layer_names(cfg)
        shown = ", ".join(names[i] if type(i) is int and 0 <= i < len(names) else str(i) for i in frozen)
        raise ConfigError(f"checkpoint {path} has frozen layers ({shown}), saved without optimizer state; "
                          "resume with freeze.enabled = true")
    hidden = prune.get("hidden") if isinstance(prune, dict) else None
    if hidden and not cfg.prune.enabled:
        raise ConfigError(f"checkpoint {path} holds structurally pruned blocks (narrower MLPs); resume with "
                          "prune.enabled = true and prune.structured = true")


def _saved_setting(path: str, section: str, name: str):
    """A setting of the config.toml saved beside a checkpoint, or None if it is not there."""
    try:
        return tomllib.loads((Path(path) / "config.toml").read_text()).get(section, {}).get(name)
    except (OSError, ValueError, AttributeError):
        return None


def check_hf_files(cfg: Config) -> None:
    """Every safetensors file of `model.hf_path` opens in safetensors itself, as a rank's loader
    opens it (memory-mapped, the header only): whatever `hf_config.read_header` let through and
    safetensors would refuse on every rank after launch is refused here, naming the file."""
    if not cfg.model.hf_path:
        return
    from safetensors import SafetensorError, safe_open

    for path in sorted(set(hf_config.weight_files(Path(cfg.model.hf_path)).values())):
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{path} is not a file safetensors can open ({str(e).strip()}); "
                              f"{hf_config.COPY_AGAIN}") from None


def check_path(where: str, path: str, folder: bool) -> None:
    """A path the run will create or write: a folder (`folder`) or a file whose folder may not exist
    yet. Refuse a folder that is an existing file, a file that is an existing folder, and a path
    under an existing file."""
    p = Path(path).expanduser()
    if p.exists():
        if folder and not p.is_dir():
            raise ConfigError(f"{where}={path!r} is an existing file, not a folder; give a folder path")
        if not folder and p.is_dir():
            raise ConfigError(f"{where}={path!r} is an existing folder, not a file; give a file path")
        return
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{where}={path!r}: {parent} is a file, so nothing can be created under it")
            return


def check_files(cfg: Config) -> None:
    """The run folder, the trace file and the data cache can be written; the text exists."""
    check_path("out", cfg.out, folder=True)
    if cfg.log.trace:
        check_path("log.trace", cfg.log.trace, folder=False)
    if cfg.data.cache_dir:
        check_path("data.cache_dir", cfg.data.cache_dir, folder=True)
    for path in cfg.data.paths:
        if not Path(path).exists():
            raise ConfigError(f"data path {path!r} does not exist (data.paths takes text files or folders)")
    if not cfg.data.paths:
        from dynmo.data import DataError, default_corpus_dir

        try:
            default_corpus_dir()
        except DataError as e:
            raise ConfigError(str(e)) from None
