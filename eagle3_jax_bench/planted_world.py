"""A planted-acceptance world: a target and an EAGLE-3 drafter with random weights at a preset's shapes whose
greedy drafts are accepted with a chosen probability `a` per position, for end-to-end benchmarks (planted.py).

The token universe is U target ids (U <= the hidden sizes, the draft vocabulary and the drafter's intermediate
size), draft id j being universe[j] (d2t). On it:
  * f, a random cyclic permutation: the target's next token after x is f(x). Every layer is random at the
    preset's shapes, but its attention output (wo) and MLP output (w_down, every expert's in a MoE layer) are
    scaled by EPSILON: a step reads and multiplies what a real one does, while the residual stream stays the
    current token's embedding e_x. Embedding rows of the universe are orthogonal (norm sqrt(D)) and the lm_head
    row of f(x) is e_x, so the argmax is f(x) with a margin of about D against 0, bf16 rounding included.
  * g, the drafter's next token: g(x) = f(x) on a random fraction a of the universe (of the positions along
    f's cycle modulo a period: `World`), f(f(x)) elsewhere. The drafter's hidden carries its own prediction as
    an orthogonal code c_t: fc maps the captured features (each ~ e_x) to c_{f(x)}; the MLP is a lookup table
    over the codes (gate and up rows aligned with them, so only the current code's unit fires; its down column
    turns c_t into c_{g(t)}); lm_head rows are the codes. Attention outputs are scaled by EPSILON as in the
    target. Step k >= 2 feeds the carried hidden c_{d_k} back, so d_{k+1} = g(d_k).
A draft d_k (after an accepted chain) is accepted when g agrees with f at d_{k-1} (at x_n for d_1): each position
with probability a, independently (within a period), so tau(gamma) = (1 - a^(gamma + 1)) / (1 - a)
(`expected_tau`).
`World.continuation` gives the tokens greedy decoding must emit and `simulate` the accept lengths the engine must
report for given prompts: the bench checks every run against them, and the tests' oracle is the same check.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints.drafter import Drafter
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.config import DrafterConfig, Qwen3Config

from .inputs import random_tree

EPSILON = 1e-3  # the scale of every attention and MLP output: what the layers add to the residual stream
GATE = 8.0  # the lookup's gate pre-activation at the current code (silu(8) = 7.997), 0 at every other


@dataclasses.dataclass(frozen=True)
class World:
    """The token universe and the target's successor map f, as indices into the universe. Whether the drafter
    agrees at a token depends on the token's position along f's cycle modulo `period`: the first round(a period)
    of those residues by `rank` agree, so the agreement sets of two acceptance rates are nested. With period U
    every row meets its own agreements; with a shorter period and prompts ending at positions that are
    multiples of it (`prompts`), every row meets the same ones: rows in lockstep, whose rounds accept alike."""

    universe: np.ndarray  # [U] target ids, ascending; draft id j is universe[j]
    successor: np.ndarray  # [U] f: the target's next token after universe[i] is universe[successor[i]]
    order: np.ndarray  # [U] the cycle: order[k + 1] = successor[order[k]]
    period: int  # divides U
    rank: np.ndarray  # [period] a permutation of range(period)
    seed: int

    @property
    def size(self) -> int:
        return len(self.universe)

    def drafter_successor(self, a: float) -> np.ndarray:
        """g as indices: f where the drafter agrees (a fraction a of the universe), f(f(x)) elsewhere."""
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance a must be in [0, 1], got {a!r}")
        position = np.empty(self.size, np.int64)
        position[self.order] = np.arange(self.size)
        agree = self.rank[position % self.period] < round(a * self.period)
        return np.where(agree, self.successor, self.successor[self.successor])

    def continuation(self, prompt, count: int) -> list[int]:
        """The target's greedy continuation of a prompt: f applied to its last token, `count` times."""
        i, out = np.searchsorted(self.universe, prompt[-1]), []
        for _ in range(count):
            i = self.successor[i]
            out.append(int(self.universe[i]))
        return out

    def prompts(self, count: int, length: int, seed: int = 0) -> list[list[int]]:
        """`count` prompts of `length` universe tokens drawn uniformly; in lockstep (period < U) each ends at a
        multiple of the period along the cycle, distinct ones while there are enough."""
        rng = np.random.default_rng(seed)
        rows = rng.integers(0, self.size, (count, length))
        if self.period < self.size:
            starts = self.size // self.period
            picks = rng.permutation(starts)[:count] if count <= starts else rng.integers(0, starts, count)
            rows[:, -1] = self.order[picks * self.period]
        return self.universe[rows].tolist()


def universe_size(cfg: Qwen3Config, dcfg: DrafterConfig) -> int:
    """The largest universe the construction holds: orthogonal embeddings and codes, one lookup unit and one
    draft id per token."""
    return min(cfg.hidden_size, dcfg.hidden_size, dcfg.draft_vocab_size, dcfg.intermediate_size, cfg.vocab_size)


def make_world(cfg: Qwen3Config, dcfg: DrafterConfig, size: int | None = None, seed: int = 0,
               period: int | None = None) -> World:
    """A universe of `size` tokens (None: `universe_size`) with a random cyclic f, its agreement pattern
    repeating every `period` positions along the cycle (None: the universe's size, rows independent); refused
    where the pair cannot hold it (a tied lm_head cannot differ from the embedding)."""
    most = universe_size(cfg, dcfg)
    size = most if size is None else size
    if not 2 <= size <= most:
        raise ValueError(f"universe size must be in [2, {most}] for these shapes, got {size}")
    period = size if period is None else period
    if period < 1 or size % period:
        raise ValueError(f"the agreement period must divide the universe's size {size}, got {period}")
    if cfg.tie_word_embeddings:
        raise ValueError("a planted world needs an lm_head of its own: the target ties it to the embedding")
    if dcfg.target_hidden_size != cfg.hidden_size or dcfg.target_vocab_size != cfg.vocab_size:
        raise ValueError("the drafter's target_hidden_size and target_vocab_size must be the target's")
    rng = np.random.default_rng(seed)
    universe = np.sort(rng.choice(cfg.vocab_size, size, replace=False)).astype(np.int32)
    order = rng.permutation(size)
    successor = np.empty(size, np.int64)
    successor[order] = np.roll(order, -1)
    return World(universe, successor, order, period, rng.permutation(period), seed)


def expected_tau(a: float, gamma: int) -> float:
    """Tokens per round when each draft is accepted with probability a independently: sum of a^k, k <= gamma."""
    return float(sum(a**k for k in range(gamma + 1)))


def solve_acceptance(tau: float, gamma: int) -> float:
    """The a with expected_tau(a, gamma) = tau (bisection: it increases from 1 at a = 0 to gamma + 1 at 1)."""
    if gamma < 1 or not 1.0 <= tau <= gamma + 1:
        raise ValueError(f"tau must be in [1, gamma + 1 = {gamma + 1}] with gamma >= 1, got tau {tau!r}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tau(mid, gamma) < tau else (low, mid)
    return (low + high) / 2


def simulate(world: World, a: float, prompts, max_new: int, gamma: int, schedules=None) -> list[list[int]]:
    """The accept lengths (Result.accept_lengths) greedy speculative decoding must give on this world, with room
    in max_len: the prefill emits f(last prompt token); a round from x accepts the run of positions along f
    where g agrees, at most its gamma, and emits one more; a round cut by max_new reports at most what it
    emitted. Every round drafts `gamma` (0: spec-off, no rounds reported), or, with `schedules` (per prompt,
    the gamma of each round: Result.gammas under "auto"), the gammas given."""
    f, g = world.successor, world.drafter_successor(a)
    out = []
    for row, prompt in enumerate(prompts):
        x, left, accepts = f[np.searchsorted(world.universe, prompt[-1])], max_new - 1, []
        rounds = iter(schedules[row]) if schedules is not None else itertools.repeat(gamma) if gamma else iter(())
        for most in rounds:
            if left <= 0:
                break
            accepted, y = 0, x
            while accepted < most and g[y] == f[y]:
                accepted, y = accepted + 1, f[y]
            emitted = min(accepted + 1, left)
            accepts.append(min(accepted, emitted))
            left -= emitted
            x = f[y]
        out.append(accepts)
    return out


def _codes(seed: int, count: int, width: int) -> jax.Array:
    """count <= width orthogonal rows of norm sqrt(width) (rms 1), float32 [count, width]."""
    q, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(seed), (width, count), jnp.float32))
    return np.sqrt(width) * q.T


@jax.jit
def _quiet(w, epsilon):
    return (w * epsilon).astype(w.dtype)


_set_rows = jax.jit(lambda w, rows, values: w.at[rows].set(values.astype(w.dtype)), donate_argnums=(0,))


def _quiet_layer(layer: dict, epsilon: float) -> dict:
    """A layer whose attention and MLP outputs (wo, w_down: dense or every expert's) are scaled by epsilon."""
    return {k: _quiet(v, epsilon) if k in ("wo", "w_down") else v for k, v in layer.items()}


def embedding_codes(world: World, width: int) -> jax.Array:
    return _codes(world.seed * 2 + 1, world.size, width)


def drafter_codes(world: World, width: int) -> jax.Array:
    return _codes(world.seed * 2 + 2, world.size, width)


def planted_target(cfg: Qwen3Config, world: World, dtype, epsilon: float = EPSILON, seed: int = 1) -> Target:
    """The target of the world (module docstring), built on the device."""
    params = random_tree(target_lib.abstract_params(cfg, dtype), seed=seed)
    E, ids = embedding_codes(world, cfg.hidden_size), jnp.asarray(world.universe)
    params["embed"] = _set_rows(params["embed"], ids, E)
    params["lm_head"] = _set_rows(params["lm_head"], ids[world.successor], E)  # row f(x) is e_x
    params["final_norm"] = jnp.ones_like(params["final_norm"])
    params["layers"] = tuple(_quiet_layer(layer, epsilon) for layer in params["layers"])
    return Target(cfg, params, None)


@functools.partial(jax.jit, static_argnames=("chunks", "intermediate", "dtype"))
def _lookup(E, C, f, g, *, chunks: int, intermediate: int, dtype):
    """The drafter's fc and MLP: fc takes each of `chunks` captured features e_x to c_{f(x)} / chunks (their sum
    is c_{f(x)}); the MLP's unit t fires at the code c_t alone and adds c_{g(t)} - c_t to the residual."""
    (U, D), I = C.shape, intermediate
    fc = jnp.tile(C[f].T @ E / E.shape[1] / chunks, (1, chunks))  # [D, chunks x target D]
    gate_up = jnp.zeros((2 * I, D), jnp.float32).at[:U].set(GATE * C / D).at[I:I + U].set(C / D)
    down = jnp.zeros((D, I), jnp.float32).at[:, :U].set((C[g] - C).T / jax.nn.silu(GATE))
    return fc.astype(dtype), gate_up.astype(dtype), down.astype(dtype)


def planted_drafter(dcfg: DrafterConfig, world: World, a: float, dtype, epsilon: float = EPSILON,
                    seed: int = 2) -> Drafter:
    """The drafter of the world agreeing with the target on a fraction a of the universe, built on the device."""
    g = world.drafter_successor(a)
    params = random_tree(drafter_lib.abstract_params(dcfg, dtype), seed=seed)
    params = jax.tree.map(lambda x: jnp.ones_like(x) if x.ndim == 1 and x.dtype != jnp.int32 else x, params)
    U = world.size
    E, C = embedding_codes(world, dcfg.target_hidden_size), drafter_codes(world, dcfg.hidden_size)
    params["fc"], params["w_gate_up"], params["w_down"] = _lookup(
        E, C, jnp.asarray(world.successor), jnp.asarray(g), chunks=len(dcfg.capture_layers),
        intermediate=dcfg.intermediate_size, dtype=jnp.dtype(dtype))
    params["wo"] = _quiet(params["wo"], epsilon)
    params["lm_head"] = _set_rows(params["lm_head"], jnp.arange(U), C)
    draft_ids = np.arange(dcfg.draft_vocab_size)
    offsets = np.where(draft_ids < U, np.pad(world.universe, (0, len(draft_ids) - U)) - draft_ids, 0)
    params["d2t"] = jnp.asarray(offsets, jnp.int32)
    return Drafter(dcfg, params, None)
