"""Incremental detokenization (its deltas concatenate exactly to the text, multi-byte characters split over
byte-level tokens included) and stop strings found across any chunking, never included."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from eagle3_jax.serving.detokenizer import REPLACEMENT, Detokenizer, StopStrings

TEXT = "héllo wörld, 日本語のテキスト 🙂🚀 naïve café ½ — end"


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE with few merges: most non-ASCII characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tok.train_from_iterator(["hello world, the quick brown fox"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_deltas_concatenate_to_the_text_whatever_the_chunks(tokenizer):
    ids = tokenizer(TEXT)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    held = 0
    rng = np.random.default_rng(0)
    for chunking in range(6):
        detokenizer, deltas, at = Detokenizer(tokenizer), [], 0
        while at < len(ids):
            size = 1 if chunking == 0 else int(rng.integers(1, 5))
            delta = detokenizer.add(ids[at : at + size])
            held += delta == ""
            assert REPLACEMENT not in delta
            deltas.append(delta)
            at += size
        deltas.append(detokenizer.flush())
        assert "".join(deltas) == TEXT
    assert held > 0  # some chunks ended inside a character and were held back


def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement(tokenizer):
    ids = tokenizer("ok 🙂")["input_ids"]
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer.add(ids[:-1]) == ""  # held: the window ends inside the emoji
    tail = detokenizer.flush()
    assert tail.startswith("ok ") and tail.endswith(REPLACEMENT) and detokenizer.flush() == ""


@pytest.mark.parametrize("stops, expected", [
    (["wörld"], "héllo "),
    (["本語の", "🚀"], "héllo wörld, 日"),
    (["nowhere"], TEXT),
    (["end", "é"], "h"),
    ([""], TEXT),
])
def test_stop_strings_across_every_chunk_boundary(stops, expected):
    rng = np.random.default_rng(1)
    for trial in range(20):
        cuts = sorted(rng.choice(np.arange(1, len(TEXT)), size=int(rng.integers(0, 12)), replace=False).tolist())
        chunks = [TEXT[a:b] for a, b in zip([0] + cuts, cuts + [len(TEXT)])]
        matcher, out, hit = StopStrings(stops), [], False
        for chunk in chunks:
            text, hit = matcher.add(chunk)
            out.append(text)
            if hit:
                break
        if not hit:
            out.append(matcher.flush())
        assert "".join(out) == expected and hit == (expected != TEXT)
