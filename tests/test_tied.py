"""Tied input and output embeddings (`model.tie_embeddings = true`) across pipeline stages.

The embedding (stage 0) and the head (last stage) each keep a copy of the one tensor; their
gradients are summed every step (dynmo.runtime.tie). What the pipeline computes must be a
single-process model whose head holds the embedding's Parameter itself (tests/reference.py),
its checkpoints must store the tensor once, under the embedding's name, and a Hugging Face
checkpoint with tie_word_embeddings must load and export as such.
"""

import json
import warnings
from types import SimpleNamespace

import pytest
import torch

from dynmo import hf_config
from dynmo.model.layers import FAMILIES, build_layer, layer_class, layer_specs
from dynmo.runtime import optim
from dynmo.runtime.tie import tied_embeddings
from tests.conftest import metrics, run_train
from tests.reference import reference_run, tiny_config
from tests.test_pipeline_dist import final_weights

STEPS = 10
TIED = ("--model.tie_embeddings", "true")


# ---- one process ---------------------------------------------------------------------------
@pytest.mark.parametrize("family,block", [("gpt", "dense"), ("llama", "dense"), ("mixtral", "moe")])
def test_the_head_starts_as_the_embedding(family, block):
    cfg = tiny_config(*TIED, "--model.family", family, "--model.block", block)
    specs = layer_specs(cfg.model)
    emb_name, head_name = FAMILIES[family].tied
    embed, head = build_layer(specs[0], cfg.model, 5), build_layer(specs[-1], cfg.model, 5)
    assert torch.equal(embed.get_parameter(emb_name), head.get_parameter(head_name))
    assert embed.get_parameter(emb_name) is not head.get_parameter(head_name)
    untied = tiny_config("--model.family", family, "--model.block", block)
    plain = build_layer(specs[-1], untied.model, 5)  # untied: the head's own seeded init, as before
    assert not torch.equal(plain.get_parameter(head_name), head.get_parameter(head_name))
    for (n, a), (_, b) in zip(plain.named_parameters(), head.named_parameters()):
        assert n == head_name or torch.equal(a, b), n
    if family != "gpt":  # the names Hugging Face checkpoints use for the pair
        assert ("model." + emb_name, head_name) == (hf_config.TIED_EMBEDDING, hf_config.TIED_HEAD)


def fake_ctx(pp: int, pp_rank: int) -> SimpleNamespace:
    """A DistContext with no process groups: enough for placements that keep the pair on one rank."""
    return SimpleNamespace(pp=pp, pp_rank=pp_rank, dp=1, dp_rank=0, rank=pp_rank, pp_group=None)


def test_one_rank_holding_both_copies_sums_their_grads():
    cfg = tiny_config(*TIED)
    specs = layer_specs(cfg.model)
    last = len(specs) - 1
    layers = {0: build_layer(specs[0], cfg.model, 1), last: build_layer(specs[last], cfg.model, 1)}
    emb, head = layers[0].tok.weight, layers[last].lm_head.weight
    g_e, g_l = torch.randn_like(emb), torch.randn_like(head)
    emb.grad, head.grad = g_e.clone(), g_l.clone()
    tie = tied_embeddings(cfg.model, specs, fake_ctx(1, 0), placement=[0])
    assert tie.holds_embed and tie.holds_head and tie.group is None
    tie.sum_grads(layers)
    assert torch.equal(emb.grad, g_e + g_l) and torch.equal(head.grad, g_e + g_l)
    assert emb.grad.data_ptr() != head.grad.data_ptr()  # two copies, updated independently
    # the gradient norm counts the tensor once: in the embedding, not in the head
    assert tie.norm_skip(last) == ("lm_head.weight",) and tie.norm_skip(0) == ()
    assert optim.layer_sq_norm(layers[last], tie.norm_skip(last)) == 0  # only the tied copy has a gradient
    assert torch.allclose(optim.layer_sq_norm(layers[last]), (g_e + g_l).pow(2).sum(), rtol=1e-6, atol=0)
    # a checkpoint keys the head's copy as the embedding's tensor
    assert tie.stored_as(last, "lm_head.weight") == (0, "tok.weight")
    assert tie.stored_as(last, "ln.weight") == (last, "ln.weight")


def test_zbv_keeps_both_copies_on_rank_0_and_untied_models_have_no_pair():
    cfg = tiny_config(*TIED)
    specs = layer_specs(cfg.model)
    placement = [0, 1, 1, 0]  # zbv on 2 ranks: the last stage comes back to rank 0
    on0 = tied_embeddings(cfg.model, specs, fake_ctx(2, 0), placement)
    on1 = tied_embeddings(cfg.model, specs, fake_ctx(2, 1), placement)
    assert (on0.holds_embed, on0.holds_head, on0.group) == (True, True, None)
    assert (on1.holds_embed, on1.holds_head, on1.group) == (False, False, None)
    on1.sum_grads({})  # holds neither: nothing to do, no collective
    assert tied_embeddings(tiny_config().model, specs, fake_ctx(2, 0), placement) is None


@pytest.mark.parametrize("family,block", [("gpt", "dense"), ("llama", "dense"), ("mixtral", "moe")])
def test_tied_parameters_have_one_shape(family, block):
    cfg = tiny_config("--model.family", family, "--model.block", block)
    specs = layer_specs(cfg.model)
    with torch.device("meta"):
        embed, head = (layer_class(s, cfg.model)(cfg.model) for s in (specs[0], specs[-1]))
    emb_name, head_name = FAMILIES[family].tied
    assert embed.get_parameter(emb_name).shape == head.get_parameter(head_name).shape


# ---- two ranks, through the launcher -------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny_config("--train.steps", str(STEPS), *TIED), STEPS)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A tied 2-stage run with a checkpoint after step 4."""
    out = tmp_path_factory.mktemp("tied") / "plain"
    run_train(out, "--steps", str(STEPS), *TIED, "--checkpoint.every", "4")
    return out


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) <= 1e-6, (got, want)


@pytest.mark.dist
def test_two_stages_train_the_tied_model(plain, reference):
    assert_close([r["loss"] for r in metrics(plain)], reference[0])


@pytest.mark.dist
def test_relayouts_next_to_either_end_change_nothing_and_the_tensor_is_stored_once(tmp_path, plain, reference):
    run_train(tmp_path, "--steps", str(STEPS), *TIED, "--parallel.relayout", "3:0,1,6;6:0,5,6",
              "--checkpoint.final", "true")
    recs = metrics(tmp_path)
    assert [r["layout"] for r in recs if r["step"] in (2, 3, 6)] == [[0, 3, 6], [0, 1, 6], [0, 5, 6]]
    assert [r["loss"] for r in recs] == [r["loss"] for r in metrics(plain)]  # bitwise, whatever the layout
    flat = tmp_path / "flat"
    flat.mkdir()
    got = final_weights(tmp_path / "checkpoint-final", flat)
    _, ref_weights = reference
    assert "head.lm_head.weight" not in got and got.keys() == ref_weights.keys()
    for k in got:
        assert torch.allclose(got[k], ref_weights[k], rtol=0, atol=1e-6), k
    meta = json.loads((tmp_path / "checkpoint-final" / "dynmo.json").read_text())
    assert meta["model"]["tie_embeddings"] is True


@pytest.mark.dist
def test_re_packs_move_the_head_and_its_pair_group(tmp_path, reference):
    # 4 ranks: the pair (0, 3) gets a group of its own; the re-pack onto 3 ranks makes a new pair
    # (0, 2) while the middle ranks create the shrunk groups alongside; onto 2, the pipeline group
    run_train(tmp_path, "--steps", str(STEPS), *TIED, "--parallel.relayout", "2:0,1,3,6;5:0,2,6", nproc=4)
    recs = metrics(tmp_path)
    assert [r["workers"] for r in recs] == [4, 4, 3, 3, 3] + [2] * (STEPS - 5)
    assert_close([r["loss"] for r in recs], reference[0])


@pytest.mark.dist
def test_a_two_rank_checkpoint_resumes_on_one_rank(tmp_path, plain, reference):
    run_train(tmp_path, "--steps", str(STEPS), *TIED, "--checkpoint.resume", str(plain / "checkpoint-4"),
              "--checkpoint.final", "true", nproc=1)
    resumed = metrics(tmp_path)
    assert [r["step"] for r in resumed] == list(range(4, STEPS))
    assert_close([r["loss"] for r in resumed], reference[0][4:])
    # one rank holds both copies: it writes the tensor once, under the embedding's key
    flat = tmp_path / "flat"
    flat.mkdir()
    got = final_weights(tmp_path / "checkpoint-final", flat)
    assert "head.lm_head.weight" not in got
    assert torch.allclose(got["embed.tok.weight"], reference[1]["embed.tok.weight"], rtol=0, atol=1e-6)


# ---- Hugging Face --------------------------------------------------------------------------
def test_a_tied_hugging_face_model_loads_and_exports_tied(tmp_path):
    test_hf = pytest.importorskip("tests.test_hf")  # needs transformers
    from dynmo.export import export
    from dynmo.model.hf import HFReader, hf_state_dict

    original = test_hf.save_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in test_hf.tensors(original)
    cfg = test_hf.resolved(original)
    assert cfg.model.tie_embeddings
    with HFReader(original) as reader:
        layers = test_hf.dynmo_layers(cfg, reader)
    assert torch.equal(layers[-1].lm_head.weight, layers[0].embed_tokens.weight)
    assert layers[-1].lm_head.weight is not layers[0].embed_tokens.weight
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = test_hf.forward(layers, tokens)
        assert (logits - test_hf.hf_model(original)(tokens).logits).abs().max().item() <= 1e-5
    assert "lm_head.weight" not in hf_state_dict(dict(enumerate(layers)), layer_specs(cfg.model), cfg.model)
    ckpt = tmp_path / "checkpoint-final"
    test_hf.save_dynmo_checkpoint(ckpt, cfg, layers)
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export(ckpt, out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    test_hf.assert_same_tensors(out, original)
    test_hf.assert_loads_in_transformers(out, original)
