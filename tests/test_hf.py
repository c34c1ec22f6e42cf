"""Hugging Face checkpoints in and out: config.json -> [model], safetensors -> layers, export.

Tiny random Llama and Mixtral models are built with transformers and saved into tmp folders;
dynmo's layers loaded from them must compute transformers' logits, and an exported dynmo
checkpoint must hold the same tensors bit for bit and load back into transformers.
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dynmo import hf_config
from dynmo.config import Config, ConfigError, apply_dict, to_toml
from dynmo.data import DataError, prepare
from dynmo.model.layers import build_layer, empty_layer, layer_class, layer_specs

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402  (transformers brings it)
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers  # noqa: E402

from dynmo.model.hf import HFCheckpointError, HFReader, hf_state_dict, load_layer  # noqa: E402
from tests.conftest import ROOT, TINY, run_train  # noqa: E402

TEXT = ("the quick brown fox jumps over the lazy dog. " * 3 + "pipeline stages move layers between ranks. "
        "a mixture of experts routes each token to two experts. ") * 20
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def make_tokenizer(vocab_size: int) -> Tokenizer:
    """A small byte-level BPE whose documents start with <s>, as Llama's do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    # pad with added tokens to exactly vocab_size: the small text may not yield that many merges
    tok.add_tokens([f"<extra{i}>" for i in range(vocab_size - tok.get_vocab_size(with_added_tokens=True))])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def save_model(folder: Path, kind: str, vocab: int = 512, tokenizer_vocab: int = 300, seed: int = 0, **kw) -> Path:
    torch.manual_seed(seed)
    shape = SHAPE | {"vocab_size": vocab} | kw
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **shape, num_local_experts=4, num_experts_per_tok=2))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    make_tokenizer(tokenizer_vocab).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_model(root / kind, kind) for kind in ("llama", "mixtral")}


def resolved(folder: Path, *overrides: str) -> Config:
    cfg = Config()
    apply_dict(cfg, {"model": {"hf_path": str(folder), "seq_len": 32}})
    for i in range(0, len(overrides), 2):
        apply_dict(cfg, {"model": {overrides[i]: overrides[i + 1]}})
    hf_config.apply(cfg)
    return cfg


def hf_model(folder: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def dynmo_layers(cfg: Config, reader: HFReader, build: str = "empty") -> list[torch.nn.Module]:
    layers = []
    for spec in layer_specs(cfg.model):
        layer = (build_layer(spec, cfg.model, seed=7) if build == "build" else empty_layer(spec, cfg.model, "cpu"))
        load_layer(layer, spec, cfg.model, reader)
        layers.append(layer)
    return layers


def forward(layers, tokens: torch.Tensor) -> torch.Tensor:
    x, mask = layers[0](tokens)
    for block in layers[1:-1]:
        x, mask = block(x, mask)
    return layers[-1](x, mask)


# ---- config.json -> [model] ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_config_json_resolves_the_model(hf_dirs, kind):
    cfg = resolved(hf_dirs[kind], "d_model", 999, "n_layers", 9)  # config.json wins over [model]
    m = cfg.model
    assert (m.family, m.block) == ({"llama": ("llama", "dense"), "mixtral": ("mixtral", "moe")}[kind])
    assert (m.d_model, m.n_heads, m.n_kv_heads, m.n_layers, m.intermediate_size, m.vocab_size) == (64, 4, 2, 3, 96, 512)
    assert m.hf_path == str(hf_dirs[kind].resolve())
    if kind == "mixtral":
        assert (m.moe.num_experts, m.moe.top_k, m.moe.aux_loss_coef, m.rope_theta) == (4, 2, 0.001, 1e6)
    # the resolved config round-trips through the run folder's config.toml, and applying again changes nothing
    again = Config()
    apply_dict(again, tomllib.loads(to_toml(cfg)))
    hf_config.apply(again)
    assert again.model == m


@pytest.mark.parametrize("family,bias", [("llama", False), ("llama", True), ("mixtral", False)])
def test_pure_shape_table_matches_the_layers(family, bias):
    cfg = Config()
    apply_dict(cfg, {"model": {"family": family, "block": "moe" if family == "mixtral" else "dense",
                               "d_model": 48, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "n_layers": 2,
                               "intermediate_size": 40, "vocab_size": 77, "attention_bias": bias}})
    cfg.model.moe.num_experts = 3
    table = hf_config.param_shapes(cfg.model)
    with torch.device("meta"):
        for spec, (letter, block, params) in zip(layer_specs(cfg.model), table):
            layer = layer_class(spec, cfg.model)(cfg.model)
            assert (spec.letter, spec.block) == (letter, block)
            assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == params


def test_old_top_level_rope_theta_and_qwen2_biases():
    cfg = Config()
    cfg.model.seq_len = 32
    hf = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100, "rope_theta": 5e5,
          "sliding_window": 16, "use_sliding_window": False, "tie_word_embeddings": False}
    hf_config.resolve(cfg.model, hf, Path("config.json"))
    assert cfg.model.rope_theta == 5e5 and cfg.model.attention_bias and cfg.model.family == "llama"


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported; dynmo implements llama, mistral, qwen2, mixtral"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes' must be true or false"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_type 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "mistral", "sliding_window": 16}, "sliding_window=16 is shorter than model.seq_len=32"),
    ({"max_position_embeddings": 16}, "model.seq_len=32 exceeds max_position_embeddings=16"),
    ({"attention_bias": True}, "o_proj bias"),
    ({"num_attention_heads": 3}, "num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    ({"hidden_size": None}, "hidden_size is missing"),
])
def test_config_json_that_dynmo_does_not_implement_is_refused(change, message):
    hf = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 128}
    hf |= change
    cfg = Config()
    cfg.model.seq_len = 32
    with pytest.raises(ConfigError) as e:
        hf_config.resolve(cfg.model, {k: v for k, v in hf.items() if v is not None}, Path("config.json"))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_files_and_plain_config_options_are_refused(tmp_path, hf_dirs):
    def err(**model) -> str:
        cfg = Config()
        apply_dict(cfg, {"model": model})
        with pytest.raises(ConfigError) as e:
            hf_config.apply(cfg)
        return str(e.value)

    assert "is not a folder" in err(hf_path=str(tmp_path / "nope"))
    assert "has no config.json" in err(hf_path=str(tmp_path))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((hf_dirs["llama"] / "config.json").read_text())
    assert "no model.safetensors or model.safetensors.index.json" in err(hf_path=str(bare), seq_len=32)
    (bare / "model.safetensors").write_bytes((hf_dirs["llama"] / "model.safetensors").read_bytes())
    assert "has no tokenizer.json" in err(hf_path=str(bare), seq_len=32)
    (bare / "tokenizer.json").write_text(make_tokenizer(600).to_str())  # a 600-token vocabulary, 512 embeddings
    assert "but the model's vocab_size is 512" in err(hf_path=str(bare), seq_len=32)
    (bare / "config.json").write_text((hf_dirs["mixtral"] / "config.json").read_text())
    assert "lack" in err(hf_path=str(bare), seq_len=32)  # llama weights under a mixtral config.json


# ---- safetensors -> layers -----------------------------------------------------------------
@pytest.mark.parametrize("kind,build", [("llama", "empty"), ("llama", "build"), ("mixtral", "empty")])
def test_loaded_layers_compute_transformers_logits(hf_dirs, kind, build):
    cfg = resolved(hf_dirs[kind])
    with HFReader(hf_dirs[kind]) as reader:
        layers = dynmo_layers(cfg, reader, build)
        assert sorted(reader.names_read) == sorted(reader.keys())  # every tensor read exactly once
    ref = hf_model(hf_dirs[kind])
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = forward(layers, tokens)
        out = ref(input_ids=tokens, labels=tokens)
    assert (logits - out.logits).abs().max().item() <= 1e-5
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert abs(loss.item() - out.loss.item()) <= 1e-5


def test_reader_reads_only_the_requested_layers_of_a_sharded_checkpoint(tmp_path, hf_dirs):
    folder = tmp_path / "sharded"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model(hf_dirs["mixtral"]).save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    (folder / "tokenizer.json").write_text((hf_dirs["mixtral"] / "tokenizer.json").read_text())
    cfg = resolved(folder)
    specs = layer_specs(cfg.model)
    with HFReader(folder) as reader:
        for spec in (specs[0], specs[2]):  # the embedding and block1
            load_layer(empty_layer(spec, cfg.model, "cpu"), spec, cfg.model, reader)
        read = list(reader.names_read)
        nbytes = reader.bytes_read
    want = ["model.embed_tokens.weight"] + [n for n in hf_config.expected_tensors(cfg.model)
                                            if n.startswith("model.layers.1.")]
    assert sorted(read) == sorted(want) and len(read) == len(set(read))
    assert nbytes == 4 * sum(int(np.prod(hf_config.expected_tensors(cfg.model)[n])) for n in want)


def test_load_layer_is_strict(hf_dirs):
    cfg = resolved(hf_dirs["llama"])
    spec = layer_specs(cfg.model)[1]
    wide = Config()
    apply_dict(wide, {"model": cfg.to_dict()["model"] | {"intermediate_size": 128}})
    with HFReader(hf_dirs["llama"]) as reader:
        with pytest.raises(HFCheckpointError, match=r"mlp.gate_proj.weight has shape \[96, 64\], dynmo's block0"):
            load_layer(empty_layer(spec, wide.model, "cpu"), spec, wide.model, reader)
        biased = Config()
        apply_dict(biased, {"model": cfg.to_dict()["model"] | {"attention_bias": True}})
        with pytest.raises(HFCheckpointError, match="no tensor model.layers.0.self_attn.q_proj.bias"):
            load_layer(empty_layer(spec, biased.model, "cpu"), spec, biased.model, reader)


# ---- data ----------------------------------------------------------------------------------
def test_data_is_tokenized_with_the_folders_tokenizer(tmp_path, hf_dirs):
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    folder = prepare([str(text)], 512, str(tmp_path / "cache"), hf_path=str(hf_dirs["llama"]))
    tok = Tokenizer.from_file(str(hf_dirs["llama"] / "tokenizer.json"))
    eos = tok.token_to_id("</s>")  # tokenizer_config.json's eos_token ends every document
    assert np.fromfile(folder / "shard-00000.bin", dtype=np.uint16).tolist() == tok.encode(TEXT).ids + [eos]
    assert tok.encode(TEXT).ids[0] == 0  # the document starts with <s>
    assert prepare([str(text)], 512, str(tmp_path / "cache"), hf_path=str(hf_dirs["llama"])) == folder
    with pytest.raises(DataError, match="more than model.vocab_size 100"):
        prepare([str(text)], 100, str(tmp_path / "cache2"), hf_path=str(hf_dirs["llama"]))


# ---- export --------------------------------------------------------------------------------
def save_dynmo_checkpoint(path: Path, cfg: Config, layers) -> None:
    """What dynmo.runtime.checkpoint.save writes, from one process: `{layer}.{param}` + optim.* keys
    (a tied model's head copy is the embedding's tensor, stored once under the embedding's key)."""
    import torch.distributed.checkpoint as dcp

    specs = layer_specs(cfg.model)
    sd = {}
    for spec, layer in zip(specs, layers):
        for k, v in layer.state_dict().items():
            if cfg.model.tie_embeddings and spec.letter == "L" and k == "lm_head.weight":
                continue
            sd[f"{spec.name}.{k}"] = v
            sd[f"optim.{spec.name}.{k}.exp_avg"] = torch.zeros_like(v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    meta = {"step": 0, "model": cfg.to_dict()["model"], "layout": [0, len(specs)],
            "layer_names": [s.name for s in specs], "has_optimizer_state": True, "seed": 0, "cases": {}}
    (path / "dynmo.json").write_text(json.dumps(meta))
    (path / "config.toml").write_text(to_toml(cfg))


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def assert_same_tensors(exported: Path, original: Path) -> None:
    a, b = tensors(exported), tensors(original)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k


def assert_loads_in_transformers(folder: Path, original: Path) -> None:
    """No missing or unexpected keys, and the same logits as the original (so config.json is right too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens).logits, hf_model(original)(tokens).logits)


def dynmo_cli(*args: str, process: bool = False) -> subprocess.CompletedProcess:
    """`dynmo ARGS`: the real process with `process`, else the same `dynmo.cli.main` called in
    this process, its output captured (torch is imported here already; a process would import
    it again, seconds each). The real process runs an export after training and a refusal."""
    if process:
        return subprocess.run([sys.executable, "-m", "dynmo.cli", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
    from dynmo import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("kind,shard", [("llama", "5GB"), ("mixtral", "50KB")])
def test_export_round_trip_without_training(tmp_path, hf_dirs, kind, shard):
    cfg = resolved(hf_dirs[kind])
    with HFReader(hf_dirs[kind]) as reader:
        layers = dynmo_layers(cfg, reader)
    assert len(hf_state_dict(dict(enumerate(layers)), layer_specs(cfg.model), cfg.model)) == len(reader.keys())
    ckpt = tmp_path / "checkpoint-final"
    save_dynmo_checkpoint(ckpt, cfg, layers)
    out = tmp_path / "out"
    p = dynmo_cli("export", str(ckpt), "--hf", str(out), "--max-shard-size", shard)
    assert p.returncode == 0, p.stderr
    assert "copied tokenizer.json, tokenizer_config.json" in p.stdout
    assert (out / "model.safetensors.index.json").is_file() == (shard != "5GB")
    assert_same_tensors(out, hf_dirs[kind])
    assert_loads_in_transformers(out, hf_dirs[kind])
    assert (out / "tokenizer.json").read_bytes() == (hf_dirs[kind] / "tokenizer.json").read_bytes()
    # a second export into the same folder needs --force, and then replaces the shards
    p = dynmo_cli("export", str(ckpt), "--hf", str(out))
    assert p.returncode == 2 and "is not empty" in p.stderr
    p = dynmo_cli("export", str(ckpt), "--hf", str(out), "--force")
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in out.glob("*.safetensors")) == ["model.safetensors"]
    assert_same_tensors(out, hf_dirs[kind])


def test_export_bad_input_is_one_line_and_status_2(tmp_path):
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "dynmo.json").write_text(json.dumps({"step": 1, "model": Config().to_dict()["model"]}))
    (gpt / ".metadata").write_bytes(b"")
    cases = [
        ((str(tmp_path / "missing"), "--hf", str(tmp_path / "o1")), "does not exist"),
        ((str(tmp_path), "--hf", str(tmp_path / "o2")), "is not a dynmo checkpoint"),
        ((str(gpt), "--hf", str(tmp_path / "o3")), "only llama and mixtral families export"),
    ]
    for i, (args, message) in enumerate(cases):
        p = dynmo_cli("export", *args, process=i == 0)
        assert p.returncode == 2 and message in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_train_with_lr_0_then_export_gives_the_checkpoint_back(tmp_path, hf_dirs, kind):
    out = tmp_path / "run"
    p = run_train(out, "--model.hf_path", str(hf_dirs[kind]), "--train.lr", "0", "--train.min_lr", "0",
                  "--steps", "2", "--checkpoint.final", "true")
    # each rank read only its own layers' tensors: together every tensor once
    reads = re.findall(r"dynmo: rank \d+ read (\d+) tensors \(", p.stdout)
    counts = [int(c) for c in reads]
    total = len(tensors(hf_dirs[kind]))
    assert len(counts) == 2 and all(0 < c < total for c in counts) and sum(counts) == total, reads
    # the 2-stage pipeline's first loss is transformers' loss on the same batch
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(first - hf_loss(hf_model(hf_dirs[kind]), hf_dirs[kind], [(0, "train")])) <= 1e-5
    recorded = (out / "config.toml").read_text()
    assert f'family = "{kind}"' in recorded and "d_model = 64" in recorded  # the resolved fields
    # the data went through the folder's tokenizer.json (cached by its content), not a trained BPE
    ours = (hf_dirs[kind] / "tokenizer.json").read_bytes()
    cache = Path(os.environ["DYNMO_CACHE"])
    assert any((f / "tokenizer.json").read_bytes() == ours for f in cache.glob("prepared-*"))
    exported = tmp_path / "hf"
    p = dynmo_cli("export", str(out / "checkpoint-final"), "--hf", str(exported))
    assert p.returncode == 0, p.stderr
    assert_same_tensors(exported, hf_dirs[kind])
    assert_loads_in_transformers(exported, hf_dirs[kind])


def hf_loss(model, hf_dir: Path, batches: list[tuple[int, str]]) -> float:
    """Mean next-token cross entropy of `model` over dynmo's batches (the tiny run's data)."""
    from dynmo.data import TokenData

    cfg = Config()
    apply_dict(cfg, {"model": {"hf_path": str(hf_dir), "seq_len": 32}, "train": {"global_batch": 8}})
    hf_config.apply(cfg)
    folder = prepare(cfg.data.paths, cfg.model.vocab_size, cfg.data.cache_dir, cfg.model.hf_path)
    data = TokenData.load(folder, cfg.model.seq_len, cfg.data.val_fraction, cfg.train.seed)
    losses = []
    for step, split in batches:
        b = torch.from_numpy(data.batch(step, cfg.train.global_batch, split))
        with torch.no_grad():
            logits = model(b[:, :-1]).logits
        losses.append(float(F.cross_entropy(logits.flatten(0, 1).float(), b[:, 1:].flatten())))
    return sum(losses) / len(losses)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["mixtral"])  # the family whose export has the most mapping (stacked experts)
def test_after_training_the_exported_model_gives_dynmos_validation_loss(tmp_path, hf_dirs, kind):
    out = tmp_path / "run"
    run_train(out, "--model.hf_path", str(hf_dirs[kind]), "--train.lr", "1e-3", "--steps", "3",
              "--train.eval_every", "3", "--train.eval_batches", "2", "--checkpoint.final", "true",
              "--parallel.relayout", "1:0,1,5")
    val = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    exported = tmp_path / "hf"
    p = dynmo_cli("export", str(out / "checkpoint-final"), "--hf", str(exported), process=True)
    assert p.returncode == 0, p.stderr
    trained = hf_model(exported)
    assert abs(val - hf_loss(trained, hf_dirs[kind], [(0, "val"), (1, "val")])) <= 1e-5
    assert abs(val - hf_loss(hf_model(hf_dirs[kind]), hf_dirs[kind], [(0, "val"), (1, "val")])) > 1e-3  # it trained


# ---- bad input through the launcher --------------------------------------------------------
def edit_config(folder: Path, **change) -> None:
    hf = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize("case,message", [
    ("model_type", "model_type 'gpt_neox' is not supported; dynmo implements llama, mistral, qwen2, mixtral"),
    ("no_weights", "has no model.safetensors or model.safetensors.index.json"),
    ("big_vocab", "has 400 tokens but the model's vocab_size is 320"),
])
def test_dynmo_train_refuses_a_bad_hf_folder_before_torchrun(tmp_path, case, message):
    folder = save_model(tmp_path / "m", "llama", vocab=320, tokenizer_vocab=400 if case == "big_vocab" else 300)
    if case == "model_type":
        edit_config(folder, model_type="gpt_neox")
    elif case == "no_weights":
        (folder / "model.safetensors").unlink()
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", "2", "--out", str(tmp_path / "run"), *TINY,
           "--model.hf_path", str(folder)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "torch.distributed" not in p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_half_block_units_read_their_halves_of_the_checkpoint(hf_dirs, kind):
    """With `parallel.unit = "sublayer"` each half block reads exactly its own tensors (strict
    both ways) and the units compute what the whole blocks compute; the export gives back every
    tensor under its Hugging Face name."""
    cfg = resolved(hf_dirs[kind])
    specs = layer_specs(cfg.model, "sublayer")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with HFReader(hf_dirs[kind]) as reader:
        whole = dynmo_layers(cfg, reader)
        halves = []
        for spec in specs:
            halves.append(empty_layer(spec, cfg.model, "cpu"))
            load_layer(halves[-1], spec, cfg.model, reader)
        names = set(reader.keys())
    with torch.no_grad():
        assert torch.equal(forward(halves, tokens), forward(whole, tokens))
    assert set(hf_state_dict(dict(enumerate(halves)), specs, cfg.model)) == names
