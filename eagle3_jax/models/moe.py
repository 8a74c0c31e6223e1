"""The Qwen3-MoE sparse MLP as pure functions: the router, then the routed experts' SiLU-gated MLPs.

Parameters of a sparse layer (transformers 5's fused layout, weights [out, in]):
    router [E, D], w_gate_up [E, 2I, D] (gate rows first, then up), w_down [E, D, I].

Four ways to run the experts, each reading only the experts some token was routed to and never computing
all E experts:
  * `experts_gathered` (few tokens): the distinct routed experts (at most min(M k, E)) are gathered once
    and every token is run through each of them; the combine weights are zero where a token did not
    choose the expert. Wasted FLOPs are M x (slots) rows of a matvec: free while the step is memory bound.
  * `experts_tiled` (many tokens: prefill chunks): the (token, choice) pairs sorted by expert into tiles
    of one expert each (tile_rows), the tiles' weights gathered, then batched GEMMs over the tiles. It pays
    a gathered copy of about pairs / tile + E experts and up to E x tile padded rows; it needs no
    scatter-add.
  * `experts_grouped`: the pairs sorted by expert, then two grouped GEMMs (`lax.ragged_dot_general`), each
    group multiplied by its expert's weights only. How much of the weights a grouped GEMM streams is its
    lowering's business: on the stored [E, out, in] layout XLA's costs about what reading every expert
    does, whatever the token count (figures below). No default choice takes it; the benchmark compares it.
  * `experts_kernel` (few tokens, GPU): the gathered path's arithmetic in pallas_kernels.moe_experts,
    which streams each routed expert's weights once from where they are stored, with no gathered copy.
`moe_mlp` picks one by the static token count M = B T and the kernels (`choose_path`). `moe_reference`
(all experts, dense) is the tests' oracle only.

Where the paths cross (H200, jax 0.11.2, 2026-12-02: 8 MoE layers of Qwen3-30B-A3B, bf16, random routing,
ms; `bench --model qwen3-30b-a3b --experts-only`):
    tokens      1     2     4     8    16    32
    kernel    0.46  0.76  1.21  2.07  3.26  4.62   (the down stage in one group of slots)
    gathered  0.48  2.56  2.01  3.80  7.37  7.46
    grouped   7.46  7.51  7.58  7.82  8.22  9.04
The kernel is fastest at every count, and gathered beats grouped at every one (grouped on the stored layout
pays about 7.5 ms per 8 layers at any count). These counts cover a decode or verify step of up to batch 8 x
4 tokens and hold no crossover, so both thresholds below are the largest count measured (64 tokens is timed
by the bench's experts section). At 32 tokens the gathered copy is nearly every expert of a layer (about
1.2 GB, transient, one layer at a time).

Past 32 tokens (H200, jax 0.11.2, 2026-12-04; the same 8 layers, `--experts-only`'s chunks section, ms; tiled at
tile_rows' tile, the best other tile in brackets):
    tokens      64           256           2048
    grouped   12.50         32.56         232.7
    tiled     10.06 (9.77)  10.94 (10.91)  16.17 (16.21)
So tiled runs past GATHER_MAX_TOKENS: a 2,048-token chunk of the whole target (48 layers) prefills in 0.136 s
instead of 1.40 s. Its gathered weights are transient, one layer at a time: at 2,048 tokens 191 tiles of 9.4 MB
(1.8 GB) on Qwen3-30B-A3B, 7.2 GB on Qwen3-235B-A22B's widths unsharded.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

import pallas_kernels
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models.config import MoeConfig

# At most this many tokens per step take the gathered path with XLA's kernels, the tiled one past them
# (gathered measured faster than grouped at 1 to 32 tokens, tiled than grouped at 64 to 2,048: the tables above;
# gathered against tiled is not measured at 33 to 63). Every step past it takes tiled: prefill chunks, and
# verify or mixed steps of more than 32 tokens.
GATHER_MAX_TOKENS = 32
# With the Pallas kernels, at most this many tokens per step take pallas_kernels.moe_experts (fastest at 1 to
# 32 tokens: the table above; it takes up to 64 rows); past it the XLA path.
KERNEL_MAX_TOKENS = 32


def route(x: jax.Array, router: jax.Array, top_k: int, normalize: bool,
          select: str = "rank") -> tuple[jax.Array, jax.Array]:
    """x [M, D] -> (weights [M, k] in x's dtype, expert ids [M, k] int32), as transformers routes: logits
    in x's dtype, softmax in float32, top-k of the probabilities, renormalised when `normalize`. select: how
    the top k are found, "rank" (top_k_ranked, no sort), "sort" (lax.top_k) or "kernel" (the softmax, top-k
    and renormalisation in pallas_kernels.route_top_k, interpreted off the GPU); all the same ids in the same
    order, ties to the lower index."""
    logits = jnp.einsum("md,ed->me", x, router)
    if select == "kernel":
        return pallas_kernels.route_top_k(logits.astype(jnp.float32), k=top_k, normalize=normalize,
                                          out_dtype=x.dtype, interpret=kernels_lib.interpret())
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = TOP_K[select](probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), ids.astype(jnp.int32)


def choose_router(tokens: int, cfg: MoeConfig, kernels: str) -> str:
    """How a step of `tokens` rows finds its top k (route's select): the router kernel where the routed experts may
    take their Pallas kernel (at most KERNEL_MAX_TOKENS rows, the counts measured with it) and it takes the shapes
    (an H200 measured XLA's softmax and top-k at six small fusions, about 11 us a layer: pallas_kernels/moe_router.py),
    else top_k_ranked."""
    if kernels_lib.experts_in_pallas(kernels) and tokens <= KERNEL_MAX_TOKENS and not \
            pallas_kernels.route_top_k_unsupported(tokens, cfg.num_experts, cfg.num_experts_per_tok):
        return "kernel"
    return "rank"


def top_k_ranked(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k(values [M, E], k) without a sort: an entry's rank is how many entries are greater, or equal
    at a lower index (lax.top_k's order: descending, ties to the lower index), and the entries of rank
    0 .. k-1 are the top k in order. E^2 comparisons per row, a few elementwise-and-reduce kernels where a
    GPU sort of 128 entries is a launch of its own (an H200 measured the router's sort at 3.2 us a layer)."""
    E = values.shape[-1]
    index = jnp.arange(E)
    # The ranks are a permutation only if every comparison sees the same bits of an entry. Unbarred, XLA on a
    # GPU fused the softmax into the comparisons and recomputed it there with bits that disagreed: on an H200
    # two entries shared a rank at 8 and 32 rows (one weight doubled, one zero). The barrier materialises
    # `values` once.
    values = jax.lax.optimization_barrier(values)
    a, b = values[:, :, None], values[:, None, :]  # [M, e, j]: entry e against entry j
    ahead = (b > a) | ((b == a) & (index[None, None, :] < index[None, :, None]))
    rank = jnp.sum(ahead, axis=-1, dtype=jnp.int32)  # [M, E], a permutation of 0 .. E-1
    chosen = rank[:, None, :] == jnp.arange(k)[None, :, None]  # [M, k, E]: one entry each
    ids = jnp.sum(jnp.where(chosen, index, 0), axis=-1)
    return jnp.sum(jnp.where(chosen, values[:, None, :], 0), axis=-1).astype(values.dtype), ids


TOP_K = {"rank": top_k_ranked, "sort": jax.lax.top_k}  # route's selects over the probabilities


def _swiglu(h: jax.Array) -> jax.Array:
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * up


def routed_slots(weights: jax.Array, ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Routing [M, k] -> (slots [S], combine [M, S]): the S = min(M k, E) distinct ids, padded with E (no
    expert), and each token's weight on each slot (zero where it did not choose it). One token's k choices
    are distinct already: its slots are its ids as routed; more tokens' are in ascending order (distinct_ids)."""
    M, k = ids.shape
    if M == 1:
        return ids[0], weights
    slots = distinct_ids(ids, num_experts, min(M * k, num_experts))
    return slots, jnp.einsum("mk,mks->ms", weights, (ids[:, :, None] == slots).astype(weights.dtype))


def distinct_ids(ids: jax.Array, num_experts: int, size: int) -> jax.Array:
    """jnp.unique(ids, size=size, fill_value=num_experts) without a sort: the experts routed to in ascending
    order, then num_experts; an expert's place is how many routed experts have a lower id (comparisons over
    E x E, fused elementwise-and-reduce kernels where a GPU sort is a launch of its own)."""
    experts = jnp.arange(num_experts, dtype=ids.dtype)
    present = jnp.any(ids.reshape(-1, 1) == experts, axis=0)  # [E]
    place = jnp.sum(present[None, :] & (experts[None, :] < experts[:, None]), axis=1)  # [E]
    hit = present[None, :] & (place[None, :] == jnp.arange(size)[:, None])  # [size, E]: one expert or none
    return jnp.where(jnp.any(hit, axis=1), jnp.sum(jnp.where(hit, experts, 0), axis=1), num_experts)


def experts_gathered(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate_up: jax.Array,
                     w_down: jax.Array) -> jax.Array:
    """x [M, D], routing [M, k] -> [M, D], through the distinct routed experts gathered once.

    The padded slots (routed_slots) gather zeros (mode="fill") and get zero combine weight, so no expert
    is read twice."""
    slots, combine = routed_slots(weights, ids, w_gate_up.shape[0])
    gate_up = jnp.take(w_gate_up, slots, axis=0, mode="fill", fill_value=0)  # [S, 2I, D]
    down = jnp.take(w_down, slots, axis=0, mode="fill", fill_value=0)  # [S, D, I]
    h = _swiglu(jnp.einsum("md,sod->smo", x, gate_up))  # [S, M, I]
    y = jnp.einsum("smi,sdi->smd", h, down)
    return jnp.einsum("ms,smd->md", combine, y)


def experts_kernel(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate_up: jax.Array,
                   w_down: jax.Array, **tuning) -> jax.Array:
    """x [M, D], routing [M, k] -> [M, D] through pallas_kernels.moe_experts: each distinct routed expert's
    weights streamed once from where they are stored, no gathered copy (interpreted off the GPU). tuning:
    fields of pallas_kernels.ExpertsConfig (the benchmark times other tunings through it)."""
    E = w_gate_up.shape[0]
    slots, combine = routed_slots(weights, ids, E)
    # One row's slots are its k distinct choices, all real (a constant, not a kernel of its own).
    count = jnp.full((1,), slots.shape[0], jnp.int32) if ids.shape[0] == 1 else \
        jnp.sum(slots < E, keepdims=True).astype(jnp.int32)
    return pallas_kernels.moe_experts(x, combine.T, slots, count, w_gate_up, w_down,
                                      interpret=kernels_lib.interpret(), **tuning)


_RAGGED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),  # contract lhs [m, in] with rhs [g, out, in]'s `in`
    lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def ragged_dot_out_in(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs [m, in] (rows grouped) times rhs [g, out, in] (weights as transformers stores them) -> [m, out]."""
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, _RAGGED)


def experts_grouped(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate_up: jax.Array,
                    w_down: jax.Array, ragged_dot=ragged_dot_out_in) -> jax.Array:
    """x [M, D], routing [M, k] -> [M, D] by grouped GEMMs over the (token, choice) pairs sorted by expert.
    ragged_dot(lhs, w, group_sizes) multiplies by the expert weights in whatever layout they are given
    (the benchmark times other grouped GEMMs on [E, in, out] copies through it)."""
    M, k = ids.shape
    E = w_gate_up.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # [M k]: pairs grouped by expert, in expert order
    token = order // k
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    h = _swiglu(ragged_dot(x[token], w_gate_up, sizes))  # [M k, I]
    y = ragged_dot(h, w_down, sizes)  # [M k, D]
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(y)


def tile_rows(pairs: int, num_experts: int) -> int:
    """A tile's rows for experts_tiled: twice the mean group size (pairs over experts) as a power of two in
    [128, 256]. Wider tiles mean fewer tiles, so fewer gathered weights (about pairs / tile + E tiles) for
    more padded rows (at most E x tile). On the H200 it came within 3% of the best tile timed at 64, 256 and
    2,048 tokens (the module docstring's table)."""
    mean = -(-pairs // num_experts)
    return min(256, max(128, 1 << (2 * mean - 1).bit_length()))


def experts_tiled(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate_up: jax.Array,
                  w_down: jax.Array, tile: int | None = None) -> jax.Array:
    """x [M, D], routing [M, k] -> [M, D] by batched GEMMs over tiles of `tile` rows, each tile one expert's.

    The (token, choice) pairs are sorted by expert and each expert's run is padded to whole tiles, so tile
    n multiplies its rows by one expert's weights (gathered per tile: an expert of g pairs is read
    ceil(g / tile) times). The tile count is a static bound, (M k + min(E, M k) (tile - 1)) // tile; tiles
    past the used ones gather zeros (mode="fill") and their rows are never read. Each token's k results are
    gathered back and summed in choice order: no scatter-add, so the sum's order is fixed. tile: None takes
    tile_rows (the benchmark times others)."""
    M, k = ids.shape
    E, D = w_gate_up.shape[0], x.shape[1]
    pairs = M * k
    tile = tile_rows(pairs, E) if tile is None else tile
    tiles = (pairs + min(E, pairs) * (tile - 1)) // tile
    flat = ids.reshape(-1)  # pair p = token p // k, choice p % k
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # pairs per expert
    tile_end = jnp.cumsum((sizes + tile - 1) // tile)  # [E]: one past each expert's last tile
    first_row = (tile_end - (sizes + tile - 1) // tile) * tile  # [E]: each expert's first row
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    expert = flat[order]
    rank = jnp.arange(pairs, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[expert]  # place within its expert
    row = jnp.zeros(pairs, jnp.int32).at[order].set(first_row[expert] + rank)  # each pair's row
    token_of_row = jnp.full(tiles * tile, M, jnp.int32).at[row].set(jnp.arange(pairs, dtype=jnp.int32) // k)
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(tiles), side="right")  # E past the used tiles
    xs = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[token_of_row].reshape(tiles, tile, D)
    gate_up = jnp.take(w_gate_up, tile_expert, axis=0, mode="fill", fill_value=0)  # [tiles, 2I, D]
    down = jnp.take(w_down, tile_expert, axis=0, mode="fill", fill_value=0)  # [tiles, D, I]
    h = _swiglu(jnp.einsum("ntd,nod->nto", xs, gate_up))
    y = jnp.einsum("nti,ndi->ntd", h, down).reshape(tiles * tile, D)
    return jnp.einsum("mk,mkd->md", weights, y[row].reshape(M, k, D))


PATHS = {"gathered": experts_gathered, "grouped": experts_grouped, "kernel": experts_kernel,
         "tiled": experts_tiled}


def choose_path(tokens: int, dtype, kernels: str) -> str:
    """The expert path for a step of `tokens` rows: with the Pallas kernels (the GPU's), the expert kernel
    up to KERNEL_MAX_TOKENS rows where it takes the shapes, else (and with XLA's) gathered up to
    GATHER_MAX_TOKENS, tiled past them. A kernel refusing a shape is logged once with the path taken."""
    xla_path = "gathered" if tokens <= GATHER_MAX_TOKENS else "tiled"
    if not kernels_lib.experts_in_pallas(kernels) or tokens > KERNEL_MAX_TOKENS:
        return xla_path
    reason = pallas_kernels.moe_experts_unsupported(tokens, dtype)
    if reason:
        _log_once(f"MoE expert kernel cannot take {reason}; the {xla_path} path runs instead")
        return xla_path
    return "kernel"


@functools.cache
def _log_once(message: str) -> None:
    logging.getLogger(__name__).warning(message)


def moe_mlp(x: jax.Array, layer: dict, cfg: MoeConfig, path: str = "auto",
            kernels: str = "xla") -> tuple[jax.Array, jax.Array]:
    """The sparse MLP of x [B, T, D] -> ([B, T, D], the expert ids [B T, k] it routed to); path "auto"
    chooses by the static token count B T and the kernels (choose_path), a name in PATHS forces one."""
    B, T, D = x.shape
    flat = x.reshape(B * T, D)
    weights, ids = route(flat, layer["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob,
                         choose_router(B * T, cfg, kernels))
    if path == "auto":
        path = choose_path(B * T, x.dtype, kernels)
    with jax.named_scope(f"moe_{path}"):
        return PATHS[path](flat, weights, ids, layer["w_gate_up"], layer["w_down"]).reshape(B, T, D), ids


def moe_reference(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate_up: jax.Array,
                  w_down: jax.Array) -> jax.Array:
    """Every expert on every token, weighted by the routing (zero where not chosen): the tests' oracle."""
    E = w_gate_up.shape[0]
    dense = jnp.einsum("mk,mke->me", weights, jax.nn.one_hot(ids, E, dtype=weights.dtype))  # [M, E]
    h = _swiglu(jnp.einsum("md,eod->emo", x, w_gate_up))
    return jnp.einsum("me,emd->md", dense, jnp.einsum("emi,edi->emd", h, w_down))
