"""Log-probabilities under the target, on the device: each token's raw log-softmax (before temperature, penalties and
filters, as vLLM returns by default) and the TOP most likely tokens with theirs, computed where the logits already
are and packed into the operation's one transfer (round_output.py). Built only into a step that asks for them
(spec_round.StepSpec.logprobs, prompt_logprobs).

* A round: at each verified position, the logits the verify forward computed; the host keeps the emitted
  positions', so speculation changes no value: a token's logprob is its logits' at the position that chose it,
  whatever the drafts around it.
* A prompt's first token: the logits its last chunk computed for the draw.
* A prompt's own tokens (echo with logprobs; lm-evaluation-harness's loglikelihood): each chunk position's
  next-token log-softmax, from the hidden states the chunk's forward computed anyway, through the lm_head in
  slices of PROMPT_SLICE positions (a [C, V] float32 block at Qwen3's vocabulary and a 2,048-token chunk would take
  1.2 GB): one more matmul of the chunk against the lm_head, no second forward.

A row of the packed block (`width`): the token's logprob, the TOP ids (descending, of equal logits the higher id
first: candidate_filter's order), their logprobs; floats bitcast into the int32 packing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.decoding import candidate_filter
from eagle3_jax.models import qwen3 as target_lib

TOP = 20  # the most alternatives a request may ask for (OpenAI's limit); every logprobs step computes this many
PROMPT_SLICE = 128  # positions of a prompt's lm_head matmul at a time


def width() -> int:
    """Packed columns of one position."""
    return 1 + 2 * TOP


def columns(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """float32 logits [R, V] and the tokens they chose [R] -> [R, width()] int32: the tokens' logprobs and the TOP
    most likely (ids, logprobs), floats bitcast."""
    R, V = logits.shape
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, jnp.clip(tokens, 0, V - 1)[:, None], axis=-1)[:, 0] - lse
    padded = candidate_filter.padded(logits, candidate_filter.BLOCKS)
    # padded holds whole blocks of 64: at least TOP entries, those past the vocabulary -inf with ids >= V
    values, ids = candidate_filter.candidates(padded, TOP, candidate_filter.BLOCKS)

    def bits(x):
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)

    return jnp.concatenate([bits(chosen)[:, None], ids.astype(jnp.int32), bits(values - lse[:, None])], axis=1)


def prompt_columns(tparams, hidden: jax.Array, next_tokens: jax.Array, kernels: str) -> jax.Array:
    """hidden [C, D] (a chunk's final hidden states) and each position's next token [C] -> [C, width()]: each
    position's next-token `columns`, through the lm_head PROMPT_SLICE positions at a time."""
    C, D = hidden.shape
    pad = -C % PROMPT_SLICE
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, PROMPT_SLICE, D)
    tokens = jnp.pad(next_tokens, (0, pad)).reshape(-1, PROMPT_SLICE)
    out = jax.lax.map(lambda x: columns(target_lib.logits(tparams, x[0], kernels), x[1]), (hidden, tokens))
    return out.reshape(-1, width())[:C]


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability under the target (its raw log-softmax) and the most likely tokens at its position,
    (id, logprob) in descending order."""

    logprob: float
    top: list[tuple[int, float]]


def unpack(packed: np.ndarray, k: int) -> list[TokenLogprobs]:
    """Host rows [N, width()] int32 -> each position's TokenLogprobs with its top k (a vocabulary smaller than TOP
    pads with -inf, left out)."""
    floats = np.ascontiguousarray(packed).view(np.float32)
    chosen, ids, values = floats[:, 0].tolist(), packed[:, 1 : 1 + TOP].tolist(), floats[:, 1 + TOP :].tolist()
    return [TokenLogprobs(c, [(t, v) for t, v in zip(i[:k], x[:k]) if v != -np.inf])
            for c, i, x in zip(chosen, ids, values)]
