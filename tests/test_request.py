"""The request (decoding/request.py), Engine's arguments and the round output's layout (decoding/round_output.py),
on the host: no weights, no compilation."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.checkpoints.drafter import Drafter
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.decoding import logprobs
from eagle3_jax.decoding.engine import Engine
from eagle3_jax.decoding.request import Request, bucket_length
from eagle3_jax.decoding.round_output import RoundOutput, pack, width
from eagle3_jax.parallel.mesh import tp_mesh
from eagle3_jax_bench import presets


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
                  jnp.array([1, 0]), jnp.array([False, True]), jnp.array([[3, 4], [0, 0]]))
    assert packed.shape == (2, width(gamma)) == (2, 2 * gamma + 6)
    out = RoundOutput.unpack(np.asarray(packed), gamma)
    assert out.tokens == [[7, 8], []] and out.drafts.tolist() == [[7, 1], [2, 3]]
    assert out.choices.tolist() == [[7, 8, 9], [4, 5, 6]] and out.accepted.tolist() == [1, 0]
    assert out.done.tolist() == [False, True] and out.emitted.tolist() == [2, 0]
    assert out.shadow.tolist() == [[3, 4], [0, 0]]
    one, no_drafts = jnp.zeros((1,), jnp.int32), jnp.zeros((1, 0), jnp.int32)
    assert RoundOutput.unpack(np.asarray(pack(one[:, None], no_drafts, one, one, one)), 0).shadow.tolist() == [[0, 0]]
    with pytest.raises(ValueError, match="a round of gamma 3 packs 12 columns \\(176 with logprobs\\), got 10"):
        RoundOutput.unpack(np.asarray(packed), 3)
    # With logprobs: their columns before the shadow's (which _catch_up writes last), floats bitcast.
    logits = jnp.array([[0.0, 2.0, 1.0]] * 3 + [[3.0, 3.0, -1.0]] * 3, jnp.float32)  # [B (gamma + 1), V]
    choices = jnp.array([[1, 2, 0], [0, 1, 2]])
    columns = logprobs.columns(logits, choices.reshape(-1)).reshape(2, gamma + 1, -1)
    packed = pack(choices, jnp.array([[7, 1], [2, 3]]), jnp.array([3, 1]), jnp.array([2, 0]),
                  jnp.array([True, False]), jnp.array([[3, 4], [0, 0]]), columns)
    assert packed.shape == (2, width(gamma, logprobs=True)) == (2, 2 * gamma + 6 + 3 * (1 + 2 * logprobs.TOP))
    out = RoundOutput.unpack(np.asarray(packed), gamma)
    assert out.shadow.tolist() == [[3, 4], [0, 0]] and out.tokens == [[1, 2, 0], [0]]
    lse = np.log(np.exp([0.0, 2.0, 1.0]).sum())
    (first, second, third) = logprobs.unpack(out.logprobs[0], 2)
    assert first.logprob == pytest.approx(2.0 - lse) and second.logprob == pytest.approx(1.0 - lse)
    assert first.top == [(1, pytest.approx(2.0 - lse)), (2, pytest.approx(1.0 - lse))]
    (tied,) = logprobs.unpack(out.logprobs[1, :1], 3)  # equal logits: the higher id first; V 3 < TOP: no padding
    assert [t for t, _ in tied.top] == [1, 0, 2] and third.logprob == pytest.approx(-lse)
    # A draft tree's round (gamma its depth): its nodes' tokens and parents, then its path, before the shadow's.
    tree = (jnp.array([[11, 12, 13], [14, 15, 16]]), jnp.array([[0, 0, 1], [0, 1, 1]]), jnp.array([[1, 3], [2, 0]]))
    packed = pack(jnp.array([[7, 8, 9], [4, 5, 6]]), jnp.array([[7, 1], [2, 3]]), jnp.array([2, 0]),
                  jnp.array([1, 0]), jnp.array([False, True]), jnp.array([[5, 6], [0, 0]]), tree=tree)
    assert packed.shape == (2, width(gamma, tree_nodes=3)) == (2, 2 * gamma + 6 + 2 * 3 + gamma)
    out = RoundOutput.unpack(np.asarray(packed), gamma, 3)
    assert out.tokens == [[7, 8], []] and [x.tolist() for x in out.tree] == [x.tolist() for x in tree]
    assert out.shadow.tolist() == [[5, 6], [0, 0]] and packed[0, -2:].tolist() == [5, 6]  # last: _catch_up's place
    with pytest.raises(ValueError, match=r"a round of gamma 2 and a tree of 4 nodes packs 20 columns \(\d+ with "
                                         r"logprobs\), got 18"):
        RoundOutput.unpack(np.asarray(packed), gamma, 4)


def engine_parts(max_positions: int = 1024):
    """A Target and a Drafter with configs and no weights (the embedding's shape and dtype alone, which size
    the pool's caches): Engine checks its arguments before touching weights."""
    target_config, drafter_config = presets.dense_pair(vocab=100, hidden=64, intermediate=128, layers=4, heads=4,
                                                       kv_heads=2, head_dim=16, theta=1e4, draft_vocab=64,
                                                       max_positions=max_positions)
    embed = jax.ShapeDtypeStruct((100, 64), jnp.float32)
    return Target(target_config, {"embed": embed}, Path()), Drafter(drafter_config, {}, Path())


@pytest.mark.parametrize("max_positions, expected", [(1024, 1024), (40960, 4096)])
def test_default_max_len_fits_the_target(max_positions, expected):
    target, drafter = engine_parts(max_positions)
    assert Engine(target, drafter).max_len == Engine(target).max_len == expected


ENGINE_INTS = {"num_draft_tokens": 3, "max_len": 64, "rounds_per_call": 4}
NOT_INTS = [2.5, 3.0, True, np.bool_(True), "3", None]


@pytest.mark.parametrize("name", ENGINE_INTS)
@pytest.mark.parametrize("bad", NOT_INTS, ids=repr)
def test_engine_refuses_every_int_argument_that_is_not_an_int(name, bad):
    target, drafter = engine_parts()
    if name == "max_len" and bad is None:
        return  # None is max_len's default
    with pytest.raises(ValueError, match=rf"{name} must be (None or )?an int .*got {re.escape(repr(bad))}"):
        Engine(target, drafter, **{**ENGINE_INTS, name: bad})


@pytest.mark.parametrize("argument, message", [
    ({"prefill_chunk": 0}, "prefill_chunk must be a positive int, got 0"),
    ({"prefill_chunk": True}, "prefill_chunk must be a positive int, got True"),
    ({"prefill_chunk": 8.0}, "prefill_chunk must be a positive int, got 8.0"),
    ({"prefill_sequences": 0}, "prefill_sequences must be None or a positive int, got 0"),
    ({"prefill_sequences": 2.0}, "prefill_sequences must be None or a positive int, got 2.0"),
    ({"prefix_caching": 1}, "prefix_caching must be a bool, got 1"),
], ids=repr)
def test_engine_refuses_bad_prefill_arguments_before_placing_anything(argument, message, monkeypatch):
    from eagle3_jax.decoding import parallel_steps

    target, drafter = engine_parts()
    monkeypatch.setattr(parallel_steps, "on_mesh", lambda *a: pytest.fail("placed the models before the check"))
    with pytest.raises(ValueError, match=message):
        Engine(target, drafter, max_len=64, max_batch=4, mesh=tp_mesh(1), **argument)


def test_engine_takes_numpy_integers():
    target, drafter = engine_parts()
    engine = Engine(target, drafter, **{k: np.int64(v) for k, v in ENGINE_INTS.items()})
    assert (engine.num_draft_tokens, engine.max_len, engine.rounds_per_call) == (3, 64, 4)
    assert all(type(x) is int for x in (engine.num_draft_tokens, engine.max_len, engine.spec.gamma))


# Each int argument of a request, with a bad value put where it goes; what the error names.
REQUEST_INTS = {
    "token id": (lambda v: {"prompts": [[1, 2], [3, v]]}, r"prompt 1 has .* at position 1: token ids are ints"),
    "max_new_tokens": (lambda v: {"max_new_tokens": v}, "max_new_tokens must be a positive int"),
    "stop id": (lambda v: {"stop_token_ids": [5, v]}, "stop token id .* is not an int in the vocabulary"),
    "top_k": (lambda v: {"temperature": 1.0, "top_k": v}, "top_k must be an int"),
    "top_k per prompt": (lambda v: {"temperature": 1.0, "top_k": [0, v]}, r"top_k must be an int .*\(prompt 1\)"),
    "seed": (lambda v: {"temperature": 1.0, "seed": v}, "seed must be None or an int"),
    "seed per prompt": (lambda v: {"temperature": 1.0, "seed": [1, v]}, r"seed must be None or an int .*\(prompt 1\)"),
}


@pytest.mark.parametrize("argument", REQUEST_INTS)
@pytest.mark.parametrize("bad", [v for v in NOT_INTS if v is not None], ids=repr)
def test_request_refuses_every_int_argument_that_is_not_an_int(argument, bad):
    where, message = REQUEST_INTS[argument]
    with pytest.raises(ValueError, match=message):
        build(**{"prompts": [[1, 2], [3, 4]], **where(bad)})


def test_request_takes_numpy_integers():
    r = build([np.array([1, 2], np.int32), [np.int64(3), np.uint8(4)]], np.int64(5), np.array([7]),
              temperature=1.0, top_k=np.int32(2), seed=np.uint64(3))
    assert r.tokens[:, :2].tolist() == [[1, 2], [3, 4]] and r.max_new.tolist() == [5, 5] and r.stop_ids[0, 0] == 7
    assert r.sampling.top_k.tolist() == [2, 2] and r.sampling.seed.tolist() == [[0, 3], [0, 3]]


BAD_SEQUENCES = [
    ("abc", {}, "prompts must be a non-empty list of token-id lists"),
    (np.zeros((2, 2, 2), np.int32), {}, r"prompts must be a list of token-id lists \(or a 2-D array\), got a 3-D"),
    ([[1], "ab"], {}, "prompt 1 must be a list of token ids, got str"),
    ([[1], [2], 3], {}, "prompt 2 must be a list of token ids, got int"),
    ([[1], {2: 3}], {}, "prompt 1 must be a list of token ids, got dict"),
    ([[1], [[2]]], {}, r"prompt 1 has \[2\] at position 0"),
    ([[1], np.array([1.0])], {}, "prompt 1 must be a 1-D array of integer token ids, got 1-D float64"),
    ([[1], np.array([True])], {}, "prompt 1 must be a 1-D array of integer token ids, got 1-D bool"),
    (np.array([[1.5, 2.0]]), {}, "prompt 0 must be a 1-D array of integer token ids"),
    ([[1]], {"stop_token_ids": 0}, "stop_token_ids must be a list of token ids, got 0"),
    ([[1]], {"stop_token_ids": "ab"}, "stop_token_ids must be a list of token ids, got 'ab'"),
    ([[1]], {"stop_token_ids": [[1], 2]}, r"stop token id \[1\] is not an int"),
]


@pytest.mark.parametrize("prompts, kwargs, message", BAD_SEQUENCES, ids=[m[:30] for _, _, m in BAD_SEQUENCES])
def test_request_refuses_bad_sequences_naming_the_prompt(prompts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(prompts, **kwargs)
