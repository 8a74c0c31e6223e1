"""EAGLE-3's training-time test (TTT): the drafter unrolled over k steps, and its loss, as pure functions.

The inputs are in SpecForge's training layout (`specforge_layout` builds it from a sequence): row t pairs
the target feature g_t with x_{t+1} and is taught the target's distribution at position t + 1, i.e. over
x_{t+2}. Step k feeds every row the drafter's own output of step k - 1 with ids, teacher and masks shifted
left by k, at RoPE position t + k. Its queries see the step-0 keys causally plus, from each step 1..k, the
key of their own row only (SpecForge's `cache_hidden` attention, `generate_eagle3_mask` in flex form).

The loss of step k is SpecForge's soft cross-entropy: the target's softmax over the draft vocabulary (its
logits at the draft ids, renormalised) against the drafter's log-softmax, summed over rows whose target
argmax is in the draft vocabulary and whose loss mask is set, divided by B * T (every slot, masked or
not, as SpecForge's `LogSoftmaxLoss` divides). Steps are weighted decay**k (`ploss_decay`, 0.8).
Accuracy k is SpecForge's: the drafter's argmax (mapped by d2t) equals the target's full-vocabulary
argmax, over loss-masked rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax.models.config import DrafterConfig
from eagle3_jax.models.eagle3 import draft_logits, layer, project_features
from eagle3_jax.models.layers import apply_rope


def shift_left(x: jax.Array, k: int) -> jax.Array:
    """x [B, T, ...] moved k rows to the left along T, zero-filled at the end (SpecForge's `padding`)."""
    if k == 0:
        return x
    return jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)


def specforge_layout(tokens, target_logits, loss_mask):
    """A sequence's tokens [B, T], the target's logits at each position [B, T, V] and the per-token loss
    mask [B, T] -> SpecForge's (input_ids, teacher logits, loss mask): ids and logits one row to the left
    (`TargetHead.preprocess`); the loss mask stays where it is. The caller zeroes each row's last real
    token in the mask (SpecForge's data normaliser), whose teacher would be the next sequence's or none."""
    return shift_left(tokens, 1), shift_left(target_logits, 1), loss_mask


def _attention(q, keys, values):
    """q [B, T, N, H]; keys/values: one [B, T, K, H] per step so far. keys[0] (step 0) is seen causally,
    every later step's key only on the query's own row. Scores and softmax in float32, as SpecForge."""
    B, T, N, H = q.shape
    K = keys[0].shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scale = H**-0.5
    causal = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]  # [T(query), S(key)]
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, keys[0], preferred_element_type=jnp.float32) * scale
    scores = jnp.where(causal, scores, -jnp.inf)
    diagonal = [jnp.einsum("btkgh,btkh->bkgt", qg, k, preferred_element_type=jnp.float32)[..., None] * scale
                for k in keys[1:]]
    probs = jax.nn.softmax(jnp.concatenate([scores, *diagonal], axis=-1), axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs[..., :T], values[0], preferred_element_type=jnp.float32)
    for i, v in enumerate(values[1:]):
        out = out + jnp.einsum("bkgt,btkh->btkgh", probs[..., T + i], v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(B, T, N, H)


def drafter_step(params, cfg: DrafterConfig, embed, h, input_ids, positions, keys, values):
    """One TTT step of the standard (Llama-layer) drafter over all rows: the inference layer
    (`models/eagle3.py`'s `layer`) with the TTT attention in place of the KV cache. h [B, T, D] is fc(features)
    at step 0, else the previous step's pre-norm output. Returns (output [B, T, D], keys, values with this
    step's appended)."""
    B, T, _ = h.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def ttt_attention(qkv, cos, sin):
        q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
        q = apply_rope(q.reshape(B, T, N, H), cos, sin)
        step_keys = keys + (apply_rope(k.reshape(B, T, K, H), cos, sin),)
        step_values = values + (v.reshape(B, T, K, H),)
        return _attention(q, step_keys, step_values), (step_keys, step_values)

    h, (keys, values) = layer(params, cfg, embed, h, input_ids, positions, ttt_attention, "xla")
    return h, keys, values


def teacher(target_logits, d2t, loss_mask):
    """SpecForge's `_compute_target_p`: from the target's logits [B, T, V] (float32), the softmax over the
    draft vocabulary [B, T, Vd], the full-vocabulary argmax [B, T], and the position mask [B, T]: loss mask
    and the argmax inside the draft vocabulary."""
    draft_ids = jnp.arange(d2t.shape[0]) + d2t  # sorted target ids of the draft vocabulary
    logits = target_logits.astype(jnp.float32)
    probs = jax.nn.softmax(jnp.take(logits, draft_ids, axis=-1), axis=-1)
    argmax = jnp.argmax(logits, axis=-1)
    in_draft = jnp.zeros((logits.shape[-1],), bool).at[draft_ids].set(True)
    return probs, argmax, in_draft[argmax] * loss_mask.astype(jnp.float32)


def ttt_losses(params, cfg: DrafterConfig, embed, features, input_ids, target_logits, loss_mask,
               steps: int) -> tuple[jax.Array, jax.Array]:
    """Per-step losses [steps] and accuracies [steps] of the TTT unroll, inputs in SpecForge's layout
    (`specforge_layout`): features [B, T, C], input_ids [B, T], target_logits [B, T, V], loss_mask [B, T]."""
    B, T = input_ids.shape
    probs, argmax, position_mask = teacher(target_logits, params["d2t"], loss_mask)
    loss_mask = loss_mask.astype(jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h, keys, values = project_features(params, cfg, features), (), ()
    losses, accuracies = [], []
    for k in range(steps):
        with jax.named_scope(f"ttt_step_{k}"):
            h, keys, values = drafter_step(params, cfg, embed, h, shift_left(input_ids, k), positions + k, keys,
                                           values)
            logits = draft_logits(params, cfg, h)
            log_q = jax.nn.log_softmax(logits, axis=-1)
            cross = jnp.sum(shift_left(probs, k) * log_q, axis=-1)
            losses.append(-jnp.sum(shift_left(position_mask, k) * cross) / (B * T))
            draft_id = jnp.argmax(logits, axis=-1)
            hit = (draft_id + params["d2t"][draft_id]) == shift_left(argmax, k)
            mask_k = shift_left(loss_mask, k)
            accuracies.append(jnp.sum(hit * mask_k) / jnp.maximum(jnp.sum(mask_k), 1e-6))
    return jnp.stack(losses), jax.lax.stop_gradient(jnp.stack(accuracies))


def weighted_loss(losses: jax.Array, decay: float) -> jax.Array:
    """The training objective: sum over steps of decay**k times step k's loss (SpecForge's ploss_decay)."""
    return jnp.sum(losses * decay ** jnp.arange(losses.shape[0], dtype=jnp.float32))
