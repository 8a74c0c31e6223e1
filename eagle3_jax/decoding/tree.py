"""Draft trees (EAGLE-2/3's dynamic tree, SGLang's expansion): the shape an engine drafts, the tree chosen from the
drafter's candidates, and the acceptance of one root path, greedy or by lossless sampling. Pure functions over
device arrays; spec_round's tree round (`_tree_round`) puts them together and the drafter's expansion is
models/eagle3.py's `draft_tree`.

A round drafts `depth` levels of `top_k` beams: level 1 is the drafter's top_k tokens after the newest committed
pair, and each further step scores the beams' top_k children by the path's summed log-probability, keeping the
best top_k as the next beams; every scored child is a candidate (top_k + (depth - 1) top_k^2 of them). The tree is
the best `nodes` candidates by score, in level order: a child never scores above its parent (log p <= 0) and
comes after it, so with ties kept in index order the chosen nodes are a connected tree under the root, the newest
token x_n. The target verifies the root and the nodes in one forward (node i at key slot n + i, RoPE position n +
its depth, seeing the committed keys and its ancestors: kv_cache.Layout.tree), and the round accepts one root
path:

- greedy: the longest path each of whose nodes is the target's argmax at its parent (siblings are distinct, so
  at most one child matches);
- sampled (`TreeSpeculativeSamplingTargetOnly`, SGLang; EAGLE's `evaluate_posterior`): the drafts are the
  drafter's deterministic top_k, so q is one-hot at each node. At each node of the path one uniform u is drawn;
  its children, in node order x_1 .. x_k, take the intervals [sum_{j<i} p(x_j), sum_{j<=i} p(x_j)) of [0, 1),
  p the target's filtered distribution at the node, and the child whose interval holds u is accepted (the first
  whose cumulative probability exceeds u). When none does (u >= sum_j p(x_j)), the next token is drawn from p
  with every child's token removed, renormalised. So child i is accepted with probability p(x_i), and a token y
  outside the children comes with probability (1 - sum_j p(x_j)) p(y) / (1 - sum_j p(x_j)) = p(y): each emitted
  token is distributed as p exactly, the chain's rule for one-hot q (Leviathan et al.) with k drafts at once.
  A node past the row's room (the cache's end, and a slot past max_len whose page a row never holds) is not
  judged: it takes no interval, nor is its token removed.
After the round, the accepted path's target KV is copied from its nodes' slots into position order (n + 1 ..
n + accepted; `kv_cache.copy_entries`), and the drafter's KV is rebuilt from the path's target features, as after
a chain: a rejected node's entries lie past the committed length, never read again nor cached.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax.decoding import grammar as grammar_lib
from eagle3_jax.decoding import sampling as sampling_lib
from eagle3_jax.models.collectives import FULL, Vocab
from eagle3_jax.models.kv_cache import Layout, copy_entries, mask_words


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """A draft tree's static shape: `nodes` drafts (N, the root not counted) chosen from `depth` (D) drafting steps
    of `top_k` (K > 1) beams."""

    nodes: int
    depth: int
    top_k: int

    def __post_init__(self):
        problem = shape_problem(self.nodes, self.depth, self.top_k)
        if problem:
            raise ValueError(problem)

    @property
    def candidates(self) -> int:
        """The scored candidates the nodes are chosen from: K + (D - 1) K^2."""
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def reach(self) -> int:
        """Positions past a row's committed length a round writes: the root and the nodes in the target's KV, the
        beams' tree region ((D - 1) K entries) in the drafter's."""
        return max(self.nodes + 1, (self.depth - 1) * self.top_k)


def shape_problem(nodes, depth, top_k) -> str | None:
    """Why (num_draft_tokens, draft_depth, draft_top_k) = (nodes, depth, top_k) is no tree (ints, checked by the
    caller), or None: a tree has depth <= nodes (each level holds a node) and nodes <= K + (D - 1) K^2 (the
    candidates)."""
    if depth > nodes:
        return f"draft_depth={depth} is more than num_draft_tokens={nodes}: each level of a tree holds a node"
    most = top_k + (depth - 1) * top_k**2
    if nodes > most:
        return (f"num_draft_tokens={nodes} is more than the {most} candidates of draft_depth={depth} steps of "
                f"draft_top_k={top_k} beams (K + (D - 1) K^2)")
    return None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """One round's draft tree per row: node 0 is the root (the newest token x_n), nodes 1 .. N the drafts in level
    order (a parent before its children)."""

    tokens: jax.Array  # [B, N] int32: nodes 1 .. N's target ids
    parents: jax.Array  # [B, N + 1] int32: each node's parent node (the root's: 0)
    depth: jax.Array  # [B, N + 1] int32: the root 0, level-1 nodes 1, ...
    ancestors: jax.Array  # [B, N + 1, N + 1] bool: node i's ancestors and itself (the root in every row)

    def layout(self, page_table, n, write) -> Layout:
        """The verify forward's layout: the root and the nodes at key slots n .. n + N, RoPE positions n + depth, each
        seeing the committed keys and its ancestors."""
        return Layout.tree(page_table, n, n, n[:, None] + self.depth, mask_words(self.ancestors), write)


def build(scores, tokens, parents, nodes: int, depth: int) -> Tree:
    """The tree of the best `nodes` of the drafter's candidates (models/eagle3.draft_tree: scores, tokens, parents
    [B, C], parents as candidate indices, -1 for level 1), in candidate (level) order; lax.top_k keeps equal scores
    in index order, so a parent (lower index, never a lower score) is chosen before its child."""
    B = scores.shape[0]
    _, chosen = jax.lax.top_k(scores, nodes)
    chosen = jnp.sort(chosen, axis=1)
    parent_candidate = jnp.take_along_axis(parents, chosen, axis=1)
    is_parent = parent_candidate[:, :, None] == chosen[:, None, :]  # [B, N, N]
    parent = jnp.where(parent_candidate < 0, 0, 1 + jnp.argmax(is_parent, axis=-1)).astype(jnp.int32)
    parent = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), parent], axis=1)
    size = nodes + 1
    ancestors = jnp.broadcast_to(jnp.eye(size, dtype=bool), (B, size, size))
    node = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (B, size))
    for _ in range(depth):  # every node is at most `depth` steps below the root, whose parent is itself
        node = jnp.take_along_axis(parent, node, axis=1)
        ancestors = ancestors | jax.nn.one_hot(node, size, dtype=bool)
    return Tree(jnp.take_along_axis(tokens, chosen, axis=1), parent,
                (jnp.sum(ancestors, axis=-1) - 1).astype(jnp.int32), ancestors)


def automaton_states(tables: grammar_lib.Tables, rows: grammar_lib.Rows, tree: Tree, depth: int) -> jax.Array:
    """[B, N + 1]: each node's automaton state (decoding/grammar.py) after its path's tokens, the root's the row's own
    (FREE for a free row, and below a token its automaton does not allow): the chain's `grammar.along`, down every
    branch, one level a step."""
    states = jnp.broadcast_to(rows.state[:, None], tree.parents.shape)
    tokens = jnp.concatenate([jnp.zeros_like(tree.tokens[:, :1]), tree.tokens], axis=1)
    for _ in range(depth):  # a node's parent's state is right after as many steps as the parent's depth
        after = grammar_lib.advance(tables, rows.table[:, None], jnp.take_along_axis(states, tree.parents, axis=1),
                                    tokens)
        states = jnp.where(jnp.arange(tree.parents.shape[1])[None, :] == 0, rows.state[:, None], after)
    return states


def usable(tree: Tree, room, slots_left) -> jax.Array:
    """[B, N + 1] bool: the nodes a round may accept: at most `room` [B] deep (the cache's end) and at a key slot
    below n + slots_left [B] (max_len - n: a row holds no page past max_len, so a node there was never written);
    the root always."""
    node = jnp.arange(tree.depth.shape[1])[None, :]
    return (node == 0) | ((tree.depth <= room[:, None]) & (node < slots_left[:, None]))


def path_of(tree: Tree, match, depth: int):
    """The accepted path from per-node verdicts match [B, N + 1] (the root True; a node matches when its parent
    accepts it): (path [B, depth + 1] node ids, path[0] the root and path[d] the node at depth d, 0 past the
    path's end; accepted [B], the path's depth). A node is on the path when it and all its ancestors match; at
    most one node a level does."""
    on_path = jnp.all(~tree.ancestors | match[:, None, :], axis=-1)
    deepest = jnp.where(on_path, tree.depth, -1)
    accepted = jnp.max(deepest, axis=-1)
    end = jnp.argmax(deepest, axis=-1)
    along = jnp.take_along_axis(tree.ancestors, end[:, None, None], axis=1)[:, 0]  # [B, N + 1]: end's ancestors
    at = along[:, None, :] & (tree.depth[:, None, :] == jnp.arange(depth + 1)[None, :, None])  # [B, D + 1, N + 1]
    return jnp.argmax(at, axis=-1).astype(jnp.int32), accepted.astype(jnp.int32)


def greedy_match(tree: Tree, argmax, ok) -> jax.Array:
    """[B, N + 1]: each node's token is the target's argmax at its parent (argmax [B, N + 1], after each node), for
    the nodes `ok` [B, N + 1] (usable)."""
    at_parent = jnp.take_along_axis(argmax, tree.parents[:, 1:], axis=1)
    return jnp.concatenate([jnp.ones_like(ok[:, :1]), tree.tokens == at_parent], axis=1) & ok


def sampled_match(tree: Tree, p: sampling_lib.Filtered, keys, ok) -> jax.Array:
    """[B, N + 1]: the node each parent's uniform falls on among its children's intervals (the module docstring),
    p the target's filter over B (N + 1) rows (row b (N + 1) + j: after node j of row b), keys [B] the rows' round
    keys (sampling.row_keys); nodes not `ok` take no interval."""
    B, size = tree.parents.shape
    parent = tree.parents[:, 1:]
    p_node = jnp.where(ok[:, 1:], p.prob(jnp.arange(B)[:, None] * size + parent, tree.tokens), 0.0)  # [B, N]
    node = jnp.arange(size - 1)
    siblings = parent[:, :, None] == parent[:, None, :]  # [B, N, N]
    cumulative = jnp.sum(jnp.where(siblings & (node[None, :] <= node[:, None])[None], p_node[:, None, :], 0.0), -1)
    u = sampling_lib.uniforms(keys, size)
    below = ok[:, 1:] & (jnp.take_along_axis(u, parent, axis=1) < cumulative)
    # The first sibling whose cumulative probability passes u: the sums only grow along the siblings.
    earlier = jnp.any(siblings & (node[None, :] < node[:, None])[None] & below[:, None, :], axis=-1)
    return jnp.concatenate([jnp.ones((B, 1), bool), below & ~earlier], axis=1)


def final_token(tree: Tree, p: sampling_lib.Filtered, keys, ok, end, vocab: Vocab = FULL) -> jax.Array:
    """[B]: the token drawn after the path's end node end [B]: from p there with the tokens of its children that
    were judged (ok) removed, renormalised (p itself when they hold all its mass, up to rounding)."""
    B, size = tree.parents.shape
    probs = p.rows(jnp.arange(B) * size + end).probs()  # [B, V] (this device's slice under a sharded vocab)
    V = probs.shape[-1]
    children = (tree.parents[:, 1:] == end[:, None]) & ok[:, 1:]
    # The rejected children as the chain's q (sampling.residual): one-hot at each, so the residual is p without them.
    rejected = jnp.zeros_like(probs).at[jnp.arange(B)[:, None], jnp.where(children, vocab.local_index(tree.tokens, V),
                                                                          V)].set(1.0, mode="drop")
    left = sampling_lib.residual(probs, rejected)
    left = jnp.where(vocab.sum(left, keepdims=True) > 0, left, probs)
    return sampling_lib.draw(keys, left, vocab)


def commit(pages, page_table, n, path, accepted, live):
    """The target's pages with the accepted path's KV (node path[d] at slot n + path[d]) at slots n + 1 .. n +
    accepted, for the rows `live` [B]: in position order, as committed KV is (the root is at n already)."""
    depth = jnp.arange(1, path.shape[1])[None, :]
    dest = jnp.where(live[:, None] & (depth <= accepted[:, None]), n[:, None] + depth, -1)
    return copy_entries(pages, page_table, n[:, None] + path[:, 1:], dest)


def greedy_path(tree: Tree, argmax, ok, depth: int):
    """A greedy row's path: (path [B, depth + 1], accepted [B], choices [B, depth + 1]: the target's argmax
    (argmax [B, N + 1], after each node) at each node of the path, the last of them its bonus token)."""
    path, accepted = path_of(tree, greedy_match(tree, argmax, ok), depth)
    return path, accepted, jnp.take_along_axis(argmax, path, axis=1)


def sampled_path(tree: Tree, logits, settings: sampling_lib.SamplingParams, keys, ok, depth: int, vocab: Vocab,
                 *, filter: str):
    """A sampled row's path by the multi-draft rule (the module docstring) over the target's logits [B, N + 1, V]
    filtered by each row's settings: (path, accepted, choices [B, depth + 1]: the accepted nodes' tokens, then
    the token drawn after them, then padding)."""
    B, size, V = logits.shape
    p = sampling_lib.filter_rows(logits.reshape(B * size, V),
                                 *(jnp.repeat(x, size) for x in (settings.temperature, settings.top_k, settings.top_p)),
                                 vocab, filter=filter)
    path, accepted = path_of(tree, sampled_match(tree, p, keys, ok), depth)
    end = jnp.take_along_axis(path, accepted[:, None], axis=1)[:, 0]
    final = final_token(tree, p, keys, ok, end, vocab)
    step = jnp.arange(depth + 1)[None, :]
    child = jnp.take_along_axis(tree.tokens, jnp.maximum(jnp.concatenate([path[:, 1:], path[:, :1]], 1) - 1, 0), 1)
    choices = jnp.where(step < accepted[:, None], child, jnp.where(step == accepted[:, None], final[:, None], 0))
    return path, accepted, choices.astype(jnp.int32)
