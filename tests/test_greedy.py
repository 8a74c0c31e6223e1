"""Spec-off greedy decoding against transformers' generate(do_sample=False), token for token."""

import threading

import jax
import numpy as np
import pytest
import torch

import eagle3_jax
from eagle3_jax_bench.profile import count_compilations

from hf_models import build_model, save_model
from transfer_guard import no_implicit_transfers

PROMPTS = [[5, 17, 3, 99, 42, 8, 11], [150, 2], [7, 7, 7, 21, 64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def model_and_target(tmp_path_factory):
    model = build_model("gqa2_headdim", seed=1)
    folder = save_model(model, tmp_path_factory.mktemp("greedy"), "gqa2_headdim")
    return model, eagle3_jax.load_target(folder, dtype="float32", progress=False)


def hf_greedy(model, prompt, **kwargs):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def test_batch_matches_transformers_generate(model_and_target):
    model, tgt = model_and_target
    results = eagle3_jax.Engine(tgt, max_len=128).generate(PROMPTS, max_new_tokens=24)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == hf_greedy(model, prompt, max_new_tokens=24, min_new_tokens=24)
        assert result.finish_reason == "length" and result.accept_lengths == []


def test_stops_at_stop_token_included(model_and_target):
    model, tgt = model_and_target
    reference = hf_greedy(model, PROMPTS[0], max_new_tokens=24, min_new_tokens=24)
    stop = reference[5]
    cut = reference.index(stop) + 1
    (result,) = eagle3_jax.Engine(tgt, max_len=128).generate([PROMPTS[0]], 24, stop_token_ids=[stop, 3])
    assert result.token_ids == hf_greedy(model, PROMPTS[0], max_new_tokens=24, eos_token_id=[stop, 3])
    assert result.token_ids == reference[:cut] and result.finish_reason == "stop"


def test_stops_at_max_len(model_and_target):
    model, tgt = model_and_target
    engine = eagle3_jax.Engine(tgt, max_len=20)
    results = engine.generate(PROMPTS, max_new_tokens=50)
    for prompt, result in zip(PROMPTS, results):
        assert len(prompt) + len(result.token_ids) == 20 and result.finish_reason == "length"
        assert result.token_ids == hf_greedy(model, prompt, max_length=20, min_length=20)


def test_prompt_filling_max_len_is_refused(model_and_target):
    """A prompt of max_len tokens leaves no room for a new one: refused, with its index, before device work."""
    _, tgt = model_and_target
    engine = eagle3_jax.Engine(tgt, max_len=17)
    with pytest.raises(ValueError, match="prompt 1 has 17 tokens: it must be shorter than max_len=17"):
        engine.generate([PROMPTS[0], PROMPTS[2]], max_new_tokens=5)
    assert engine.device_events == []
    (result,) = engine.generate([PROMPTS[2][:16]], max_new_tokens=5)
    assert len(result.token_ids) == 1 and result.finish_reason == "length"


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([[]], {}, "prompt 0 is empty"),
        ([[1, 2], [3, 160]], {}, "token id 160 outside"),
        ([[1, -1]], {}, "token id -1 outside"),
        ([list(range(1, 40))], {}, "has 39 tokens: it must be shorter than max_len=32"),
        ([], {}, "non-empty list"),
        (7, {}, "non-empty list"),
        ([1, 2, 3], {}, "prompt 0 must be a list of token ids"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens"),
        ([[1]], {"max_new_tokens": True}, "max_new_tokens must be a positive int, got True"),
        ([[1]], {"stop_token_ids": [999]}, "stop token id 999 is not an int in the vocabulary"),
        ([[1]], {"stop_token_ids": [2.5]}, "stop token id 2.5 is not an int"),
        ([[45.9, 16]], {}, "prompt 0 has 45.9 at position 0: token ids are ints"),
        ([[1], [True, 16]], {}, "prompt 1 has True at position 0: token ids are ints"),
        (np.array([[1.0, 2.0]]), {}, "prompt 0 must be a 1-D array of integer token ids"),
        ([[1]], {"stop_token_ids": 0}, "stop_token_ids must be a list of token ids, got 0"),
    ],
)
def test_bad_requests_raise_before_device_work(model_and_target, prompts, kwargs, message):
    _, tgt = model_and_target
    engine = eagle3_jax.Engine(tgt, max_len=32)
    engine.generate([[1, 2]], 2)
    with count_compilations() as compiles:
        with pytest.raises(ValueError, match=message):
            engine.generate(prompts, **{"max_new_tokens": 4, **kwargs})
        with pytest.raises(ValueError, match=message):
            engine.stream(prompts, **{"max_new_tokens": 4, **kwargs})  # at the call, not at the first chunk
    assert engine.device_events == [] and compiles.count == 0


def test_the_transfer_guard_reaches_other_threads():
    """no_implicit_transfers guards every thread, as the engine's pool runs on its own; jax.transfer_guard's
    context manager guards only the thread that entered it."""
    x, failed = jax.numpy.ones(3), []

    def add_a_host_array():
        try:
            (x + np.ones(3)).block_until_ready()  # the numpy operand is an implicit transfer
        except Exception as e:  # noqa: BLE001 - jax raises its runtime error type
            failed.append("disallowed" in str(e).lower())

    for guard in (no_implicit_transfers(), jax.transfer_guard("disallow")):
        with guard:
            thread = threading.Thread(target=add_a_host_array)
            thread.start()
            thread.join()
    assert failed == [True]


def test_compiles_once_per_configuration_and_transfers_once_per_call(model_and_target):
    _, tgt = model_and_target
    # max_len 112: a configuration no other test builds, so the first request must compile.
    with count_compilations() as first_compiles:
        first = eagle3_jax.Engine(tgt, max_len=112, prefill_sequences=3).generate(PROMPTS, max_new_tokens=12)
    assert first_compiles.count >= 2  # the call of rounds with prompt tokens, and without
    with no_implicit_transfers(), count_compilations() as compiles:  # any implicit transfer raises
        engine = eagle3_jax.Engine(tgt, max_len=112, prefill_sequences=3)  # a second Engine of the same configuration
        again = engine.generate(PROMPTS, max_new_tokens=12)
        other = engine.generate([[9] * 20, [1], [4, 40]], max_new_tokens=12)  # the same shapes
    assert compiles.count == 0 and again == first
    # one transfer per call of 4 rounds: the first call's first round carries the three prompts, whose rows join for
    # its other three (each row's first token and 3 more: [4 rounds, 3 rows (a bucket of 4) + 3 segments, 6]); 8
    # tokens left, two more calls.
    transfers = [shape for kind, shape in engine.device_events if kind == "transfer"]
    assert transfers == [(4, 4 + 3, 6)] + [(4, 4, 6)] * 2  # a row: round_output.width(0) = 6
    assert [shape for kind, shape in engine.device_events if kind == "call"] == [(4, 4, 20 + 1 + 2)] + [(4, 4, 0)] * 2
    assert [len(r.token_ids) for r in first + other] == [12] * 6


def test_next_call_dispatched_early_only_when_needed(model_and_target):
    """While some row surely needs another call, it is dispatched before this call's tokens are fetched
    (the device never waits on the host); near the end it is dispatched only if the tokens say so. The
    first call carries the prompts in its first round and runs their rows in its other three, and the second
    follows it at once when some row's budget needs more than that call can emit."""
    _, tgt = model_and_target
    engine = eagle3_jax.Engine(tgt, max_len=128, prefill_sequences=3)  # 4 rounds per call, 1 token per round
    for max_new, expected in [
        # 12 tokens: the first + 11 rounds; 11 left when call 1 goes: call 2 goes early; 8 left when call 1 is
        # fetched, 4 in flight: call 3 goes early too.
        (12, ["call", "call", "transfer", "call", "transfer", "transfer"]),
        # 6 tokens: 5 left when call 1 goes, which can emit 4: call 2 goes early, the last.
        (6, ["call", "call", "transfer", "transfer"]),
        (4, ["call", "transfer"]),  # the first token and the call's other three rounds are all
        (1, ["call", "transfer"]),  # the first token is all: its rows are done when they join
    ]:
        results = engine.generate(PROMPTS, max_new_tokens=max_new)
        assert [len(r.token_ids) for r in results] == [max_new] * 3
        assert [kind for kind, _ in engine.device_events] == ["allocate"] + expected, (max_new, engine.device_events)


def test_engine_refuses_bad_settings(model_and_target):
    _, tgt = model_and_target
    with pytest.raises(ValueError, match="max_len"):
        eagle3_jax.Engine(tgt, max_len=10_000)
    with pytest.raises(ValueError, match="kernels"):
        eagle3_jax.Engine(tgt, max_len=64, kernels="cuda")
    for bad in (0, 65, 2.0, None, True):
        with pytest.raises(ValueError, match=rf"rounds_per_call must be an int in \[1, max_len=64\], got {bad}"):
            eagle3_jax.Engine(tgt, max_len=64, rounds_per_call=bad)
    engine = eagle3_jax.Engine(tgt, max_len=64, rounds_per_call=64)
    with pytest.raises(AttributeError):
        engine.rounds_per_call = 2  # the compiled scan is built for 64


def test_huge_max_new_tokens_is_bounded_by_max_len(model_and_target):
    _, tgt = model_and_target
    engine = eagle3_jax.Engine(tgt, max_len=24)
    for huge in (2**31, np.int64(2**32 + 5), 10**30):
        results = engine.generate(PROMPTS, max_new_tokens=huge)
        assert [len(p) + len(r.token_ids) for p, r in zip(PROMPTS, results)] == [24] * 3
        assert all(r.finish_reason == "length" for r in results)
