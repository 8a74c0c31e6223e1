"""Qwen3-MoE targets (float32, CPU): both expert paths against the dense reference; the target against
transformers' Qwen3MoeForCausalLM (logits, features, greedy output) for both checkpoint layouts; the
conversion round trip; refusals naming the key; speculation lossless on an MoE target."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eagle3_jax
import pallas_kernels
from eagle3_jax import CheckpointError
from eagle3_jax.checkpoints import safetensors_io
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models import moe
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.config import MoeConfig
from pallas_kernels import routed_experts

from cuda_lowering import lower_for_cuda
from hf_models import MOE_CONFIGS, build_moe_model, save_moe_model

PROMPTS = [[5, 17, 3, 99, 42, 8, 11], [150, 2], [7, 7, 7, 21, 64]]
STEPS = [[12, 77, 140], [1, 159, 30], [45, 45, 0]]  # teacher-forced decode tokens per row


forward = jax.jit(target_lib.forward_rows, static_argnums=(1, 4))  # one compile per config and shape


def padded(prompts, width=8):
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return jnp.asarray(tokens), jnp.array([len(p) for p in prompts], jnp.int32)


def rel_err(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(ours - ref)) / np.max(np.abs(ref))


def test_expert_paths_match_the_dense_reference():
    """Every path on 5 tokens x 3 choices over 8 experts: experts shared by several tokens, and some
    chosen by none (the padded slots of the gathered path and the kernel). Through the target, the golden
    tests below run the gathered path at decode and the tiled path at prefill (past GATHER_MAX_TOKENS),
    test_kernel_path_decode_matches_transformers the kernel at decode and the grouped path at prefill. D 16
    and I 12 are below the kernel's 16-wide blocks: its masked loads cover them."""
    E, D, Ie, tokens, top_k = 8, 16, 12, 5, 3
    keys = jax.random.split(jax.random.key(0), 4)
    w_gate_up, w_down = jax.random.normal(keys[0], (E, 2 * Ie, D)), jax.random.normal(keys[1], (E, D, Ie))
    x = jax.random.normal(keys[2], (tokens, D))
    weights, ids = moe.route(x, jax.random.normal(keys[3], (E, D)), top_k, normalize=True)
    np.testing.assert_allclose(np.sum(np.asarray(weights), -1), 1.0, rtol=1e-6)
    assert len(np.unique(ids)) < E and len(np.unique(ids)) < tokens * top_k
    ref = moe.moe_reference(x, weights, ids, w_gate_up, w_down)
    for path in moe.PATHS.values():
        assert rel_err(jax.jit(path)(x, weights, ids, w_gate_up, w_down), ref) < 1e-5, path.__name__


def test_ranked_top_k_and_distinct_ids_without_a_sort():
    """top_k_ranked against lax.top_k on rows with many ties (values from 4 levels: ties go to the lower
    index) and on softmax probabilities; distinct_ids against np.unique padded with E (experts shared, all 8
    routed to, few of 128). route's default (ranks) meets transformers in the golden tests below."""
    rng = np.random.default_rng(0)
    ties = rng.integers(0, 4, (6, 128)).astype(np.float32)
    logits = rng.standard_normal((5, 16)).astype(np.float32)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    ranked = jax.jit(moe.top_k_ranked, static_argnums=1)
    for values, k in ((ties, 8), (probs, 3)):
        (got_values, got_ids), (values_, ids_) = ranked(values, k), jax.lax.top_k(values, k)
        np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids_))
        np.testing.assert_array_equal(np.asarray(got_values), np.asarray(values_))
    distinct = jax.jit(moe.distinct_ids, static_argnums=(1, 2))
    for M, k, E in ((5, 3, 8), (4, 8, 128)):
        ids = rng.integers(0, E, (M, k)).astype(np.int32)
        want = np.unique(ids)
        want = np.concatenate([want, np.full(min(M * k, E) - len(want), E)])
        np.testing.assert_array_equal(np.asarray(distinct(ids, E, min(M * k, E))), want)


def xla_route(logits, k, normalize):
    """route's XLA steps after the router matmul: softmax, lax.top_k, renormalisation (the kernel's reference)."""
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    return (weights / jnp.sum(weights, -1, keepdims=True) if normalize else weights), ids


@pytest.mark.parametrize("M,E,k", [(1, 128, 8), (5, 60, 3), (32, 128, 8), (2, 6, 1), (64, 17, 17)])
def test_router_kernel_matches_softmax_and_lax_top_k(M, E, k):
    """pallas_kernels.route_top_k (interpreted; compiled on a GPU) against softmax + lax.top_k: random logits and
    logits of few levels (ties everywhere, to the lower index), experts and choices not powers of 2, one to 64
    rows, every expert chosen (17 of 17), renormalised or not, weights cast to bfloat16."""
    rng = np.random.default_rng(M + E)
    for logits in (rng.standard_normal((M, E)) * 3, rng.integers(0, 4, (M, E))):
        logits = jnp.asarray(logits, jnp.float32)
        for normalize in (True, False):
            weights, ids = pallas_kernels.route_top_k(logits, k=k, normalize=normalize, out_dtype=jnp.float32,
                                                      interpret=kernels_lib.interpret())
            want_weights, want_ids = xla_route(logits, k, normalize)
            np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
            np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6)
        low, _ = pallas_kernels.route_top_k(logits, k=k, normalize=True, out_dtype=jnp.bfloat16,
                                            interpret=kernels_lib.interpret())
        assert low.dtype == jnp.bfloat16


def test_router_kernel_refusals_and_its_choice():
    """The router kernel refuses what it cannot take, naming it; moe_mlp routes through it with the Pallas kernels
    at the token counts the routed-expert kernel takes (KERNEL_MAX_TOKENS), by ranks otherwise."""
    with pytest.raises(ValueError, match="65 rows"):
        pallas_kernels.route_top_k(jnp.zeros((65, 8)), k=2, normalize=True, out_dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="top 9 of 8 experts"):
        pallas_kernels.route_top_k(jnp.zeros((1, 8)), k=9, normalize=True, out_dtype=jnp.float32, interpret=True)
    nan = jnp.full((2, 6), jnp.nan).at[1, 2].set(1.0)  # a row of NaN logits (an overflowed step), one NaN entry
    _, ids = pallas_kernels.route_top_k(nan, k=3, normalize=True, out_dtype=jnp.float32, interpret=True)
    assert ((0 <= np.asarray(ids)) & (np.asarray(ids) < 6)).all()  # never an expert past the weights
    cfg = MoeConfig(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=())
    assert [moe.choose_router(t, cfg, "pallas") for t in (1, moe.KERNEL_MAX_TOKENS, moe.KERNEL_MAX_TOKENS + 1)] == \
        ["kernel", "kernel", "rank"]
    assert [moe.choose_router(1, cfg, kernels) for kernels in ("xla", "exact")] == ["rank", "rank"]


def test_tied_router_logits_route_as_transformers():
    """transformers' own router (Qwen3MoeTopKRouter) on router weights whose rows come in equal pairs, so every
    logit ties with another: where no tie straddles the k-th place (k even) the experts and weights are
    transformers'; where one does (k odd), ours is the lower index, as lax.top_k breaks ties. (torch.topk leaves
    that choice to its implementation: on the CPU, 8 of 28 tied entries of 128 came out as 106 to 113.)"""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    E, D = 8, 16
    pairs = torch.randn(E // 2, D)
    x = torch.randn(6, D)
    for k in (2, 4, 3):
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=k,
                                                   norm_topk_prob=True)).eval()
        with torch.no_grad():
            router.weight.copy_(pairs.repeat_interleave(2, dim=0))  # experts 2j and 2j + 1 alike
            _, scores, indices = router(x)
        for select in ("rank", "kernel", "sort"):
            weights, ids = moe.route(jnp.asarray(x.numpy()), jnp.asarray(router.weight.detach().numpy()), k, True,
                                     select)
            ids, weights = np.asarray(ids), np.asarray(weights)
            if k % 2 == 0:
                order, ref_order = np.argsort(ids, -1), np.argsort(indices.numpy(), -1)
                np.testing.assert_array_equal(np.take_along_axis(ids, order, -1),
                                              np.take_along_axis(indices.numpy(), ref_order, -1))
                np.testing.assert_allclose(np.take_along_axis(weights, order, -1),
                                           np.take_along_axis(scores.numpy(), ref_order, -1), rtol=1e-5)
            else:  # the first k - 1 are transformers'; the last is one of a tied pair: its lower member
                np.testing.assert_array_equal(np.sort(ids[:, :-1], -1), np.sort(indices.numpy()[:, :-1], -1))
                assert all(last % 2 == 0 and last + 1 not in row for last, row in zip(ids[:, -1], ids[:, :-1])), select


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def case(request, tmp_path_factory):
    model = build_moe_model(request.param)
    folder = save_moe_model(model, tmp_path_factory.mktemp(request.param), request.param)
    return request.param, model, folder, eagle3_jax.load_target(folder, dtype="float32", progress=False)


def test_layout_and_dense_layers_as_configured(case):
    name, model, folder, tgt = case
    opts = MOE_CONFIGS[name]
    fused = opts["layout"] == "fused"
    names = set(safetensors_io.weight_map(folder))
    assert any(".experts.0.gate_proj." in n for n in names) is not fused
    assert any(n.endswith(".experts.gate_up_proj") for n in names) is fused
    assert (len(list(folder.glob("*.safetensors"))) > 1) is ("shard" in opts)
    hf_sparse = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert [tgt.config.is_sparse(i) for i in range(tgt.config.num_layers)] == hf_sparse
    assert ["router" in layer for layer in tgt.params["layers"]] == hf_sparse
    i = hf_sparse.index(True)
    experts = model.model.layers[i].mlp.experts
    np.testing.assert_array_equal(tgt.params["layers"][i]["w_gate_up"], experts.gate_up_proj.detach().numpy())
    np.testing.assert_array_equal(tgt.params["layers"][i]["w_down"], experts.down_proj.detach().numpy())


def decode_steps(forward, params, cfg, cache) -> list[np.ndarray]:
    """The logits of one-token decode steps over STEPS (every prompt's next tokens, one column a step) from a
    prefilled cache, through `forward` (target_lib.forward or a jitted copy)."""
    step_logits = []
    for s in range(len(STEPS[0])):
        h, cache, _ = forward(params, cfg, jnp.array([[row[s]] for row in STEPS], jnp.int32), cache, ())
        step_logits.append(np.asarray(target_lib.logits(params, h))[:, 0])
        cache = cache.with_lengths(cache.lengths + 1)
    return step_logits


def test_prefill_decode_and_features_match_transformers(case):
    """Prefill (3 rows x 12 = 36 tokens, past GATHER_MAX_TOKENS: the tiled path, prefill's default) and
    decode steps (3 tokens: the gathered path)."""
    name, model, _, tgt = case
    cfg = tgt.config
    capture = cfg.default_capture_layers
    tokens, lengths = padded(PROMPTS, width=12)
    assert tokens.size > moe.GATHER_MAX_TOKENS
    cache = target_lib.new_row_cache(cfg, len(PROMPTS), 32, jnp.float32)
    hidden, cache, feats = forward(tgt.params, cfg, tokens, cache, capture)
    logits = target_lib.logits(tgt.params, hidden)
    cache = cache.with_lengths(lengths)
    step_logits = decode_steps(forward, tgt.params, cfg, cache)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = model(torch.tensor([prompt + STEPS[i]]), output_hidden_states=True)
        ref_logits, P = out.logits[0].numpy(), len(prompt)
        assert rel_err(logits[i, :P], ref_logits[:P]) < 1e-4, name
        for s in range(len(STEPS[i])):
            assert rel_err(step_logits[s][i], ref_logits[P + s]) < 1e-4, (name, s)
        ref_feats = np.concatenate([out.hidden_states[layer][0, :P].numpy() for layer in capture], axis=-1)
        assert rel_err(feats[i, :P], ref_feats) < 1e-4, name


def test_greedy_output_matches_transformers(case):
    """Greedy tokens of batch 3 (prefill on the tiled path, each step on the gathered path) against
    transformers' generate, through the programs the logits test compiled (the engine's own loop is checked
    in test_moe_speculation)."""
    name, model, _, tgt = case
    tokens, lengths = padded(PROMPTS, width=12)
    assert tokens.size > moe.GATHER_MAX_TOKENS
    cache = target_lib.new_row_cache(tgt.config, len(PROMPTS), 32, jnp.float32)
    hidden, cache, _ = forward(tgt.params, tgt.config, tokens, cache, tgt.config.default_capture_layers)
    last = target_lib.logits(tgt.params, hidden)[jnp.arange(len(PROMPTS)), lengths - 1]
    out = [jnp.argmax(last, -1).astype(jnp.int32)]
    cache = cache.with_lengths(lengths)
    for _ in range(7):
        h, cache, _ = forward(tgt.params, tgt.config, out[-1][:, None], cache, ())
        out.append(jnp.argmax(target_lib.logits(tgt.params, h)[:, 0], -1).astype(jnp.int32))
        cache = cache.with_lengths(cache.lengths + 1)
    ours = np.stack(out, 1)
    for prompt, row in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert row.tolist() == ref[0, len(prompt):].tolist(), name


def test_convert_round_trip(case, tmp_path):
    name, _, folder, tgt = case
    restored = eagle3_jax.load_target(eagle3_jax.convert(folder, tmp_path / "orbax", dtype="float32"),
                                      dtype="float32", progress=False)
    assert restored.config == tgt.config
    same = jax.tree.map(np.array_equal, tgt.params, restored.params)
    assert all(jax.tree.leaves(same))


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_bad")
    out = {}
    for name in MOE_CONFIGS:
        out[name] = save_moe_model(build_moe_model(name, num_layers=2, vocab=32), root / name, name)
    return out


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def drop_tensor(folder, name):
    from safetensors.torch import load_file, save_file

    file = safetensors_io.weight_map(folder)[name]  # sharded: the index still lists it
    state = load_file(file)
    del state[name]
    save_file(state, file, metadata={"format": "pt"})


def add_tensor(folder, name, tensor):
    from safetensors.torch import load_file, save_file

    file = folder / safetensors_io.SINGLE_FILE
    save_file({**load_file(file), name: tensor}, file, metadata={"format": "pt"})


PER_EXPERT, FUSED = "moe_top1_step2_sharded", "moe_top3_norm_fused"  # 2 layers: sparse layer 1 in both
REFUSALS = [
    (PER_EXPERT, lambda f: drop_tensor(f, "model.layers.1.mlp.experts.3.up_proj.weight"),
     "missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"),
    (PER_EXPERT, lambda f: drop_tensor(f, "model.layers.1.mlp.gate.weight"),
     "missing tensor 'model.layers.1.mlp.gate.weight'"),
    (PER_EXPERT, lambda f: edit_config(f, moe_intermediate_size=20),
     r"'model.layers.1.mlp.experts.0.gate_proj.weight' has shape \(24, 32\), expected \(20, 32\)"),
    (FUSED, lambda f: edit_config(f, num_local_experts=5),
     r"'model.layers.1.mlp.gate.weight' has shape \(6, 32\), expected \(5, 32\)"),
    (FUSED, lambda f: edit_config(f, moe_intermediate_size=20),
     r"'model.layers.1.mlp.experts.gate_up_proj' has shape \(6, 48, 32\), expected \(6, 40, 32\)"),
    (FUSED, lambda f: drop_tensor(f, "model.layers.1.mlp.experts.down_proj"),
     "missing tensor 'model.layers.1.mlp.experts.down_proj'"),
    (FUSED, lambda f: edit_config(f, mlp_only_layers=[]),  # layer 0 is dense in the file
     "missing tensor 'model.layers.0.mlp.gate.weight'"),
    (FUSED, lambda f: edit_config(f, shared_expert_intermediate_size=16), "shared_expert_intermediate_size"),
    (FUSED, lambda f: edit_config(f, num_experts_per_tok=7), "num_experts_per_tok=7 must be between"),
    (FUSED, lambda f: edit_config(f, decoder_sparse_step=0), "decoder_sparse_step=0"),
    (FUSED, lambda f: edit_config(f, mlp_only_layers=[2]), "mlp_only_layers holds 2"),
    (FUSED, lambda f: edit_config(f, use_sliding_window=True), "use_sliding_window"),
    (FUSED, lambda f: edit_config(f, architectures=["Qwen3ForCausalLM"]), "not a Qwen3 or Qwen3-MoE"),
    (FUSED, lambda f: edit_config(f, num_local_experts=None), "missing required key .num_local_experts."),
    (PER_EXPERT, lambda f: edit_config(f, num_hidden_layers=1),
     r"unused tensors: model\.layers\.1\.input_layernorm\.weight, model\.layers\.1\.mlp\.experts\.0\.down_proj"),
    (FUSED, lambda f: edit_config(f, num_hidden_layers=1),
     r"unused tensors: model\.layers\.1\.input_layernorm\.weight, model\.layers\.1\.mlp\.experts\.down_proj, "),
    (FUSED, lambda f: add_tensor(f, "model.layers.1.mlp.experts.0.up_proj.weight", torch.ones(24, 32)),
     r"unused tensors: model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight \("),
    (FUSED, lambda f: edit_config(f, mlp_only_layers="0,1"), "mlp_only_layers must be a list of integers, got .0,1."),
]


@pytest.mark.parametrize("index", range(len(REFUSALS)))
def test_bad_moe_checkpoints_raise_checkpoint_error(folders, tmp_path, index, monkeypatch):
    name, breaker, message = REFUSALS[index]
    folder = shutil.copytree(folders[name], tmp_path / "f")
    breaker(folder)
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: pytest.fail("device work before the checks"))
    with pytest.raises(CheckpointError, match=message):
        eagle3_jax.load_target(folder, progress=False)


def test_expert_ids_are_transformers_routing(case):
    """The routing a step reports (the benchmark's floors count its distinct experts) is transformers'."""
    name, model, _, tgt = case
    prompt = PROMPTS[0]
    cache = target_lib.new_row_cache(tgt.config, 1, 8, jnp.float32)
    ours = jax.jit(target_lib.expert_ids, static_argnums=1)(tgt.params, tgt.config, jnp.asarray([prompt]), cache.pages,
                                                           cache.layout(len(prompt)))
    with torch.no_grad():
        router_logits = model(torch.tensor([prompt]), output_router_logits=True).router_logits
    k = tgt.config.moe.num_experts_per_tok
    assert len(ours) == len(router_logits) == sum(map(tgt.config.is_sparse, range(tgt.config.num_layers)))
    for ids, ref in zip(ours, router_logits):
        np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), np.sort(ref.topk(k, -1).indices.numpy(), -1))


# ----------------------------------------------------------------------------- the expert kernel


def kernel_case(M, E, D, Ie, top_k, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    w_gate_up = (jax.random.normal(keys[0], (E, 2 * Ie, D)) / np.sqrt(D)).astype(dtype)
    w_down = (jax.random.normal(keys[1], (E, D, Ie)) / np.sqrt(Ie)).astype(dtype)
    x = jax.random.normal(keys[2], (M, D)).astype(dtype)
    weights, ids = moe.route(x, jax.random.normal(keys[3], (E, D)).astype(dtype), top_k, normalize=True)
    return x, weights, ids, w_gate_up, w_down


@pytest.mark.parametrize("M,E,D,Ie,top_k", [(1, 16, 64, 32, 4), (3, 6, 40, 24, 3), (17, 8, 32, 80, 2)])
def test_expert_kernel_matches_the_gathered_path(M, E, D, Ie, top_k):
    """pallas_kernels.moe_experts (interpreted) in float32 against the dense reference: one token (no padded
    slot), 3 tokens over 6 experts (slots padded: 9 > 6) with D and I not multiples of the blocks, also with
    16-wide blocks (several programs per expert, several K steps, the last one partial) and the down stage's
    slots in groups of 2 (the last group padded where fewer than 6 experts are routed), 17 rows (padded to
    32); in bfloat16 against the gathered path, the down stage in one group (no partial sums)."""
    x, weights, ids, w_gate_up, w_down = kernel_case(M, E, D, Ie, top_k, jnp.float32, seed=M)
    ref = moe.moe_reference(x, weights, ids, w_gate_up, w_down)
    got = moe.experts_kernel(x, weights, ids, w_gate_up, w_down)
    assert np.isfinite(np.asarray(got)).all() and rel_err(got, ref) < 1e-5
    if M == 3:
        assert len(np.unique(np.asarray(ids))) == 5  # one padded slot: the last group of 2 holds one expert
        small = moe.experts_kernel(x, weights, ids, w_gate_up, w_down, block_i=16, block_d=16, block_k=16,
                                   down_groups=3)
        assert rel_err(small, ref) < 1e-5
    low = [a.astype(jnp.bfloat16) for a in (x, weights, w_gate_up, w_down)]
    got = moe.experts_kernel(low[0], low[1], ids, low[2], low[3], down_groups=1)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, moe.experts_gathered(low[0], low[1], ids, low[2], low[3])) < 2e-2


@pytest.mark.parametrize("M,E,D,Ie,top_k,tile", [(40, 16, 24, 20, 4, None), (33, 128, 16, 12, 8, 2),
                                                 (9, 6, 40, 24, 3, 16)])
def test_tiled_path_matches_the_dense_reference(M, E, D, Ie, top_k, tile):
    """experts_tiled in float32 against the dense reference: past the 32 tokens where it takes over,
    top-8 of 128 experts (most experts hold one or two pairs, so nearly every tile is padded) with 2-row
    tiles (an expert spread over several tiles), and tiles wider than any expert's run. A skewed routing
    (every token to the same experts) puts a whole run into consecutive tiles of one expert where a tile is
    shorter than the run (the 2-row case); the last case has fewer pairs (27) than experts x tile."""
    x, weights, ids, w_gate_up, w_down = kernel_case(M, E, D, Ie, top_k, jnp.float32, seed=M)
    tiled = jax.jit(moe.experts_tiled, static_argnums=5)
    assert rel_err(tiled(x, weights, ids, w_gate_up, w_down, tile),
                   moe.moe_reference(x, weights, ids, w_gate_up, w_down)) < 1e-5
    skewed = jnp.broadcast_to(jnp.arange(top_k, dtype=ids.dtype), ids.shape)
    assert rel_err(tiled(x, weights, skewed, w_gate_up, w_down, tile),
                   moe.moe_reference(x, weights, skewed, w_gate_up, w_down)) < 1e-5


def test_tile_rows_is_twice_the_mean_group_as_a_clamped_power_of_two():
    """The tile doubles once the mean group passes 64 pairs (1,024 tokens x 8 of 128 experts), and stays in
    [128, 256] below and above."""
    assert moe.tile_rows(1024 * 8, 128) == 128 and moe.tile_rows(1032 * 8, 128) == 256
    assert [moe.tile_rows(p, 128) for p in (8, 256 * 8, 2048 * 8, 2048 * 64)] == [128, 128, 256, 256]
    assert moe.tile_rows(40 * 4, 16) == 128  # a mean of 10 pairs an expert


def test_expert_kernel_refusals_and_the_path_choice(caplog):
    """Shapes and dtypes the kernel cannot take raise ValueError naming them; moe_mlp's choice takes the
    kernel only with the Pallas kernels and few rows, and falls back (logged once) where the kernel refuses."""
    x, weights, ids, w_gate_up, w_down = kernel_case(65, 8, 16, 16, 2, jnp.float32)
    slots, combine = moe.routed_slots(weights, ids, 8)
    count = jnp.array([8], jnp.int32)
    with pytest.raises(ValueError, match="65 rows"):
        pallas_kernels.moe_experts(x, combine.T, slots, count, w_gate_up, w_down, interpret=True)
    with pytest.raises(ValueError, match="shapes do not fit"):
        pallas_kernels.moe_experts(x, combine, slots, count, w_gate_up, w_down, interpret=True)
    with pytest.raises(ValueError, match="dtype int32"):
        pallas_kernels.moe_experts(x[:4].astype(jnp.int32), combine.T[:, :4], slots, count,
                                   w_gate_up.astype(jnp.int32), w_down.astype(jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="down_groups=0 must be >= 1"):
        pallas_kernels.ExpertsConfig(down_groups=0)
    with pytest.raises(ValueError, match="x is float32 but the weights are bfloat16"):
        pallas_kernels.moe_experts(x[:4], combine.T[:, :4], slots, count, w_gate_up.astype(jnp.bfloat16),
                                   w_down.astype(jnp.bfloat16), interpret=True)
    xla = [moe.choose_path(t, jnp.float32, "xla") for t in (1, moe.GATHER_MAX_TOKENS, moe.GATHER_MAX_TOKENS + 1)]
    assert xla == ["gathered", "gathered", "tiled"]
    pallas = [moe.choose_path(t, jnp.bfloat16, "pallas") for t in (1, moe.KERNEL_MAX_TOKENS, moe.KERNEL_MAX_TOKENS + 1)]
    assert pallas == ["kernel", "kernel", "tiled"]
    assert moe.choose_path(2, jnp.float32, "exact") == "gathered"
    with caplog.at_level("WARNING"):
        assert moe.choose_path(2, jnp.int8, "pallas") == "gathered"
        assert moe.choose_path(2, jnp.int8, "pallas") == "gathered"
    assert [r.getMessage() for r in caplog.records] == [
        "MoE expert kernel cannot take dtype int8 (the expert kernel takes bfloat16, float16, float32); "
        "the gathered path runs instead"]


def test_expert_kernel_lowers_for_cuda_at_qwen3_30b_a3b_shapes():
    """The kernel's Triton lowering (what the GPU compiles) at the benchmark's shapes, from the CPU: 8 rows
    of top-8 routing over 128 experts, hidden 2048, moe_intermediate 768, bfloat16; and the router kernel's."""
    E, D, Ie, M, S = 128, 2048, 768, 8, 64
    spec = jax.ShapeDtypeStruct
    args = (spec((M, D), jnp.bfloat16), spec((S, M), jnp.bfloat16), spec((S,), jnp.int32), spec((1,), jnp.int32),
            spec((E, 2 * Ie, D), jnp.bfloat16), spec((E, D, Ie), jnp.bfloat16))
    text = lower_for_cuda(routed_experts._experts, *args, config=routed_experts.ExpertsConfig(), interpret=False)
    assert text.count("moe_gate_up") >= 1 and text.count("moe_down") >= 1 and "triton" in text
    for rows in (1, 8, 32):  # the router kernel feeding it: decode and verify steps of up to batch 8 x 4 tokens
        text = lower_for_cuda(pallas_kernels.route_top_k, spec((rows, E), jnp.float32), k=8, normalize=True,
                              out_dtype=jnp.bfloat16)
        assert "moe_router" in text and "triton" in text


def test_kernel_path_decode_matches_transformers(case, monkeypatch):
    """Decode steps (3 rows) through the router kernel and the expert kernel (interpreted) against transformers'
    logits, and greedy tokens alike; prefill is forced onto the grouped path (the golden test above runs the
    tiled one) and routes by ranks."""
    name, model, _, tgt = case
    cfg = tgt.config
    monkeypatch.setattr(moe, "choose_path", lambda tokens, dtype, kernels: "kernel" if tokens <= 16 else "grouped")
    monkeypatch.setattr(moe, "choose_router", lambda tokens, cfg, kernels: "kernel" if tokens <= 16 else "rank")
    run = jax.jit(target_lib.forward_rows, static_argnums=(1, 4))  # traced here, with the patched choice
    tokens, lengths = padded(PROMPTS)
    cache = target_lib.new_row_cache(cfg, len(PROMPTS), 32, jnp.float32)
    _, cache, _ = run(tgt.params, cfg, tokens, cache, ())  # 24 rows: the grouped path
    cache = cache.with_lengths(lengths)
    step_logits = decode_steps(run, tgt.params, cfg, cache)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = model(torch.tensor([prompt + STEPS[i]])).logits[0].numpy()
        for s in range(len(STEPS[i])):
            assert rel_err(step_logits[s][i], ref[len(prompt) + s]) < 1e-4, (name, s)
            assert np.argmax(step_logits[s][i]) == np.argmax(ref[len(prompt) + s]), (name, s)
