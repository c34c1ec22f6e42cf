"""`dynmo export CHECKPOINT_DIR --hf OUT`: a dynmo checkpoint as a Hugging Face model folder.

    dynmo export runs/x/checkpoint-final --hf exported/ [--max-shard-size 5GB] [--force]

One process, no process group: the tensor shapes come from the DCP metadata, and the weights
are read one output shard at a time (`torch.distributed.checkpoint.load(..., no_dist=True)`),
so memory holds one shard, not the model. Optimizer state (`optim.*`) is not exported. OUT gets
config.json, safetensors (sharded above --max-shard-size, with model.safetensors.index.json,
the layout transformers writes) and, when the run started from `model.hf_path`, that folder's
tokenizer files. Only llama- and mixtral-family models have a Hugging Face counterpart. A model
trained with `model.tie_embeddings` exports with `tie_word_embeddings: true` and no
`lm_head.weight` (the checkpoint holds the tied tensor once, as the embedding's).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import warnings
from pathlib import Path

from dynmo.config import Config, ConfigError, ModelConfig, apply_dict
from dynmo.hf_config import TOKENIZER_FILES

# Written to OUT; with --force, earlier copies are removed so no stale shard survives.
WEIGHT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class ExportError(ValueError):
    """Bad input to `dynmo export`: reported as one line, exit status 2."""


def parse_size(text: str) -> int:
    """"5GB" -> 5 * 10**9 bytes ("GiB" is 2**30, as transformers reads these)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not m or float(m.group(1)) <= 0:
        raise ExportError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * UNITS[m.group(2) or ""])


def read_checkpoint(path: Path) -> tuple[dict, ModelConfig]:
    """dynmo.json and the model it describes; ExportError if `path` is not a dynmo checkpoint."""
    if not path.is_dir():
        raise ExportError(f"checkpoint folder {str(path)!r} does not exist")
    if not (path / "dynmo.json").is_file() or not (path / ".metadata").is_file():
        raise ExportError(f"{path} is not a dynmo checkpoint (it needs dynmo.json and the DCP .metadata inside)")
    try:
        meta = json.loads((path / "dynmo.json").read_text())
        cfg = Config()
        apply_dict(cfg, {"model": meta["model"]})
    except (json.JSONDecodeError, KeyError, TypeError, ConfigError) as e:
        raise ExportError(f"{path}/dynmo.json is not a dynmo checkpoint description ({e})") from None
    if cfg.model.family not in ("llama", "mixtral"):
        raise ExportError(f"{path} holds a model.family = {cfg.model.family!r} model, which has no Hugging Face "
                          "counterpart; only llama and mixtral families export")
    if (cfg.model.family, cfg.model.block) not in (("llama", "dense"), ("mixtral", "moe")):
        raise ExportError(f"{path} holds {cfg.model.family} blocks of kind {cfg.model.block!r} (a router, hashed "
                          "attention), which a Hugging Face model does not compute; only dense llama and "
                          "mixtral blocks export")
    return meta, cfg.model


def check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--hf {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--hf {out} is not empty; give a new folder, or --force to overwrite its files")


def plan(path: Path, model: ModelConfig, meta: dict) -> tuple[list[tuple], list[str]]:
    """[(dcp key, spec, parameter, shape, dtype)] in model order, and the keys export skips.

    Every parameter of every layer must be in the checkpoint with the shape the config implies;
    other weight keys (what a dynamic-model case added to a layer) have no Hugging Face name.
    The head's copy of a tied embedding is not a parameter of its own: the checkpoint stores it
    as the embedding's tensor, which the export writes once.
    """
    import torch

    from dynmo.model.layers import family, layer_class, layer_specs
    from dynmo.runtime import safeload

    specs = layer_specs(model)
    tied_head = family(model).tied[1] if model.tie_embeddings else None
    if meta.get("layer_names") and meta["layer_names"] != [s.name for s in specs]:
        raise ExportError(f"{path}: its layers {meta['layer_names']} do not match its model section")
    stored = safeload.read_metadata(path).state_dict_metadata
    items, wanted = [], set()
    for spec in specs:
        with torch.device("meta"):
            layer = layer_class(spec, model)(model)
        for pname, p in layer.named_parameters():
            key = f"{spec.name}.{pname}"
            wanted.add(key)
            if spec.letter == "L" and pname == tied_head:
                continue
            info = stored.get(key)
            if info is None or not hasattr(info, "size"):
                raise ExportError(f"{path} has no tensor {key}, which the {model.family} model needs")
            if tuple(info.size) != tuple(p.shape):
                raise ExportError(f"{path}: {key} has shape {list(info.size)}, the {model.family} layer has "
                                  f"{list(p.shape)} (a pruned or resized model has no Hugging Face counterpart)")
            items.append((key, spec, pname, tuple(info.size), info.properties.dtype))
    skipped = sorted(k for k in stored if not k.startswith("optim.") and k not in wanted)
    return items, skipped


def shards(items: list[tuple], max_bytes: int) -> list[list[tuple]]:
    """Consecutive groups of at most max_bytes (a tensor larger than that gets a shard of its own)."""
    out: list[list[tuple]] = [[]]
    size = 0
    for item in items:
        n = 4 * _numel(item[3])  # written as float32
        if out[-1] and size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append(item)
        size += n
    return out


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def export(path: Path, out: Path, max_shard_bytes: int = 5 * 10**9, force: bool = False) -> dict:
    """Write the Hugging Face folder; returns what was written. Raises ExportError on bad input."""
    meta, model = read_checkpoint(path)
    check_out(out, force)
    import torch
    from safetensors.torch import save_file

    from dynmo.model.hf import HFCheckpointError, hf_config_dict, to_hf
    from dynmo.runtime import safeload

    source = Path(model.hf_path) if model.hf_path else None
    base = {}
    if source and (source / "config.json").is_file():
        base = json.loads((source / "config.json").read_text())
    try:
        config = hf_config_dict(model, base)
    except HFCheckpointError as e:
        raise ExportError(str(e)) from None
    items, skipped = plan(path, model, meta)
    groups = shards(items, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if WEIGHT_FILES.fullmatch(old.name):
            old.unlink()
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    total = 0
    for group, fname in zip(groups, names):
        sd = {key: torch.empty(shape, dtype=dtype) for key, _, _, shape, dtype in group}
        with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent
            warnings.simplefilter("ignore")
            safeload.load(sd, path, no_dist=True)
        tensors: dict[str, torch.Tensor] = {}
        for key, spec, pname, _, _ in group:
            tensors |= to_hf(spec, pname, sd[key].to(torch.float32).contiguous(), model)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map |= {name: fname for name in tensors}
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copied = []
    if source and source.is_dir():
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
                copied.append(name)
    return {"out": str(out), "files": names, "tensors": len(weight_map), "bytes": total, "step": meta.get("step"),
            "copied": copied, "skipped": skipped, "source": str(source) if source else ""}


EXAMPLES = """\
examples:
  dynmo export runs/llama/checkpoint-final --hf runs/llama-hf
  dynmo export runs/mixtral/checkpoint-final --hf runs/mixtral-hf --max-shard-size 500MB --force
"""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dynmo export",
                                 description="Write a dynmo checkpoint as a Hugging Face model folder.",
                                 epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a dynmo checkpoint folder, e.g. runs/x/checkpoint-final")
    ap.add_argument("--hf", required=True, metavar="OUT", help="output folder (Hugging Face format)")
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    ap.add_argument("--force", action="store_true", help="write into a non-empty OUT, replacing its files")
    args = ap.parse_args(argv)
    from dynmo.runtime.safeload import CheckpointError

    try:
        res = export(Path(args.checkpoint), Path(args.hf), parse_size(args.max_shard_size), args.force)
    except (ExportError, CheckpointError) as e:
        print(f"dynmo export: error: {e}", file=sys.stderr)
        return 2
    print(f"dynmo export: {res['tensors']} tensors ({res['bytes'] / 1e6:.1f} MB) of step {res['step']} -> "
          f"{res['out']} ({len(res['files'])} safetensors file{'s' if len(res['files']) > 1 else ''})")
    if res["copied"]:
        print(f"dynmo export: copied {', '.join(res['copied'])} from {res['source']}")
    else:
        print("dynmo export: tokenizer not exported (the run did not start from model.hf_path with a tokenizer "
              "folder); add a tokenizer.json to OUT before loading a tokenizer from it")
    if res["skipped"]:
        print(f"dynmo export: skipped {len(res['skipped'])} tensors with no Hugging Face name "
              f"(added by dynamic-model cases), e.g. {res['skipped'][0]}")
    return 0
