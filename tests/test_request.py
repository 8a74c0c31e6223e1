"""The request (decoding/request.py) and the round output's layout (decoding/round_output.py), on the host:
no model, no compilation."""

import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.decoding.request import Request, bucket_length
from eagle3_jax.decoding.round_output import RoundOutput, pack, width


def build(prompts, max_new_tokens=4, stop_token_ids=(), **settings):
    return Request.build(prompts, max_new_tokens, stop_token_ids, max_len=32, vocab_size=100, **settings)


def test_request_holds_one_row_per_prompt():
    r = build([[5, 6, 7], np.array([9], np.int64)], 40, [3, np.int32(4)])
    assert r.tokens.shape == (2, bucket_length(3, 32)) and r.tokens[0, :4].tolist() == [5, 6, 7, 0]
    assert r.lengths.tolist() == [3, 1] and r.max_new.tolist() == [32, 32]  # max_new_tokens at most max_len
    assert r.budget(32).tolist() == [29, 31]
    assert r.stop_ids.shape == (2, 8) and r.stop_ids[1, :3].tolist() == [3, 4, -1]
    assert r.is_stop(1, 4) and not r.is_stop(1, -1) and not r.samples and r.sampling is None


def test_request_samples_when_some_row_does():
    r = build([[1], [2]], temperature=[0.0, 0.7], top_k=[0, 5], seed=[1, 2**64 - 1])
    assert r.samples and r.sampling.temperature.tolist() == pytest.approx([0.0, 0.7])
    assert r.sampling.top_k.tolist() == [0, 5] and r.sampling.seed[1].tolist() == [2**32 - 1, 2**32 - 1]


def test_a_2d_array_of_prompts_is_a_list_of_rows():
    r = build(np.array([[1, 2], [3, 4]]))
    assert r.lengths.tolist() == [2, 2] and r.tokens[:, :2].tolist() == [[1, 2], [3, 4]]


def test_round_output_unpacks_what_pack_wrote():
    gamma = 2
    packed = pack(jnp.array([[7, 8, 9], [4, 5, 6]]), jnp.array([[7, 1], [2, 3]]), jnp.array([2, 0]),
                  jnp.array([1, 0]), jnp.array([False, True]))
    assert packed.shape == (2, width(gamma)) == (2, 2 * gamma + 4)
    out = RoundOutput.unpack(np.asarray(packed), gamma)
    assert out.tokens == [[7, 8], []] and out.drafts.tolist() == [[7, 1], [2, 3]]
    assert out.choices.tolist() == [[7, 8, 9], [4, 5, 6]] and out.accepted.tolist() == [1, 0]
    assert out.done.tolist() == [False, True]
    with pytest.raises(ValueError, match="a round of gamma 3 packs 10 columns, got 8"):
        RoundOutput.unpack(np.asarray(packed), 3)
