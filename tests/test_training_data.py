"""Training data: every bad input refused with its file and line before any device work, chat-template loss
masks, splitting and bucketing, and the draft vocabulary against SpecForge's own builder."""

import importlib
import json
import sys
import types
from collections import Counter

import numpy as np
import pytest
import torch

from eagle3_jax.checkpoints.target import Target
from eagle3_jax.models.config import Qwen3Config
from eagle3_jax.training import batching, trainer, vocab
from eagle3_jax.training.data import DataError, Sample, load_samples

V = 100

BAD_JSONL = [
    ('{"input_ids": [1, 2]}\n{"input_ids": [1, 2\n', r"bad\.jsonl:2: not valid JSON"),
    ('[1, 2]\n', r"bad\.jsonl:1: a record must be a JSON object"),
    ('{"prompt": "x"}\n', r"bad\.jsonl:1: a record needs 'conversations', 'text' or 'input_ids'"),
    ('\n{"input_ids": [1, 2, 300]}\n', r"bad\.jsonl:2: token id 300 is outside the target vocabulary \[0, 100\)"),
    ('{"input_ids": [1, -1]}\n', r"bad\.jsonl:1: token id -1 is outside"),
    ('{"input_ids": [1, "2"]}\n', r"bad\.jsonl:1: 'input_ids' must be a list of integers"),
    ('{"input_ids": []}\n', r"bad\.jsonl:1: 'input_ids' is empty"),
    ('{"input_ids": [1, 2], "loss_mask": [1]}\n', r"bad\.jsonl:1: 'loss_mask' has 1 entries, 'input_ids' 2"),
    ('{"input_ids": [1, 2], "loss_mask": [1, 2]}\n', r"bad\.jsonl:1: 'loss_mask' entries must be 0 or 1"),
    ('{"text": ""}\n', r"bad\.jsonl:1: 'text' must be a non-empty string"),
    ('{"conversations": []}\n', r"bad\.jsonl:1: 'conversations' must be a non-empty list"),
    ('{"conversations": [{"role": "robot", "content": "x"}]}\n', r"bad\.jsonl:1: message 0 has role 'robot'"),
    ('{"conversations": [{"from": "human", "value": 3}]}\n', r"bad\.jsonl:1: message 0 needs a string 'content'"),
    ('{"conversations": [{"role": "user", "content": "hi"}]}\n', r"bad\.jsonl:1: the conversation has no assistant"),
    ('{"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
     r"bad\.jsonl:1: text and conversations need a tokenizer"),
    ('', r"bad\.jsonl: no records"),
    ('{"input_ids": [1, 2], "loss_mask": [0, 0]}\n', r"bad\.jsonl: no token carries the loss"),
]


@pytest.mark.parametrize("content,message", BAD_JSONL, ids=[m for _, m in BAD_JSONL])
def test_bad_jsonl_is_refused_with_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        load_samples([tmp_path / "bad.jsonl"], None, V)


def test_bad_paths_and_files(tmp_path):
    with pytest.raises(DataError, match="nowhere: no such file or folder"):
        load_samples([tmp_path / "nowhere"], None, V)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty: folder holds no data files"):
        load_samples([tmp_path / "empty"], None, V)
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DataError, match=r"blob\.bin: not a UTF-8 text file"):
        load_samples([tmp_path / "blob.bin"], None, V)


def test_train_drafter_refuses_bad_data_before_device_work(tmp_path):
    """A target without parameters: the data check must fail before anything reads them."""
    cfg = Qwen3Config.from_dict({"model_type": "qwen3", "vocab_size": V, "hidden_size": 16, "intermediate_size": 32,
                                 "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1})
    (tmp_path / "d.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": [1, 200]}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: token id 200"):
        trainer.train_drafter(Target(cfg, {}, None), tmp_path / "d.jsonl", tmp_path / "out", trainer.TrainConfig())
    assert not (tmp_path / "out").exists()


def test_folders_text_files_and_record_forms(tmp_path):
    """Folders are read recursively in name order (hidden names skipped); pre-tokenized masks default to ones."""
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "a.jsonl").write_text(
        '{"input_ids": [5, 6, 7]}\n\n{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    (tmp_path / "data" / "sub" / "b.jsonl").write_text('{"input_ids": [9, 9]}\n')
    (tmp_path / "data" / ".hidden.jsonl").write_text("not json")
    samples = load_samples([tmp_path / "data"], None, V)
    assert [s.tokens.tolist() for s in samples] == [[5, 6, 7], [1, 2], [9, 9]]
    assert [s.loss_mask.tolist() for s in samples] == [[1, 1, 1], [0, 1], [1, 1]]
    assert samples[1].source.endswith("a.jsonl:3")


def char_tokenizer(folder):
    """A character-level fast tokenizer with a ChatML template: enough to check assistant-only loss masks."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz .,!?\n<>|_"
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(folder)
    return fast


def test_chat_template_loss_mask_covers_assistant_turns_and_their_end_token(tmp_path):
    tok = char_tokenizer(tmp_path)
    record = {"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "hi"},
                                {"from": "gpt", "value": "hello there"}, {"role": "user", "content": "more"},
                                {"role": "assistant", "content": "ok"}]}
    (tmp_path / "c.jsonl").write_text(json.dumps(record) + "\n")
    (s,) = load_samples([tmp_path / "c.jsonl"], tok, 64)
    marked = "".join(tok.convert_ids_to_tokens(s.tokens[s.loss_mask == 1].tolist()))
    assert marked == "hello there<|im_end|>ok<|im_end|>"


def test_conversations_without_a_chat_template_name_the_file_and_line(tmp_path):
    tok = char_tokenizer(tmp_path)
    tok.chat_template = None
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "o"}]
    lines = [{"text": "hi"}, {"conversations": chat}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(DataError, match=r"c\.jsonl:2: a conversation needs a chat template"):
        load_samples([tmp_path / "c.jsonl"], tok, 64)
    tok.chat_template = "{{ messages[0]['nope'].x() }}"
    with pytest.raises(DataError, match=r"c\.jsonl:2: the chat template failed on this conversation"):
        load_samples([tmp_path / "c.jsonl"], tok, 64)


def test_long_documents_are_split_and_rows_bucketed():
    long = Sample(np.arange(50, dtype=np.int32), np.ones(50, np.int8), "f:1")
    silent = Sample(np.arange(20, dtype=np.int32), np.r_[np.zeros(19), 1].astype(np.int8), "f:2")
    pieces = batching.split_long([long, silent], 16)
    assert [len(p.tokens) for p in pieces] == [16, 16, 16, 2]  # the sample with loss on its last token only: none
    assert np.array_equal(np.concatenate([p.tokens for p in pieces]), np.arange(50))
    lengths = [3, 17, 30, 5, 16, 64]
    plan = batching.epoch_plan(lengths, 2, 64, seed=1, epoch=0)
    assert sorted(i for b in plan for i in b) == list(range(6))
    assert all(len({batching.bucket_length(lengths[i], 64) for i in b}) == 1 for b in plan)
    assert plan != batching.epoch_plan(lengths, 2, 64, seed=1, epoch=1) or len(plan) == 1
    samples = [Sample(np.full(n, 7, np.int32), np.ones(n, np.int8), "x") for n in lengths]
    b = batching.assemble(samples, [1], 2, 64)
    assert b.tokens.shape == (2, 32) and b.num_tokens == 17
    assert b.loss_mask[0].tolist() == [1] * 16 + [0] * 16 and not b.loss_mask[1].any()  # last real token: no loss


def import_specforge_preprocessing():
    """specforge.data.preprocessing imports `datasets` (for other functions) at the top: a stand-in while it
    imports, as tests/drafter_oracle.py does for speculators."""
    if "specforge.data.preprocessing" in sys.modules:
        return sys.modules["specforge.data.preprocessing"]
    stub = types.ModuleType("datasets")
    stub.Dataset = type("Dataset", (), {})
    added = "datasets" not in sys.modules
    if added:
        sys.modules["datasets"] = stub
    try:
        return importlib.import_module("specforge.data.preprocessing")
    finally:
        if added:
            sys.modules.pop("datasets")


@pytest.mark.parametrize("draft,distinct", [(40, 200), (40, 25), (64, 90)])
def test_draft_vocabulary_matches_specforge(tmp_path, draft, distinct):
    pre = import_specforge_preprocessing()
    rng = np.random.default_rng(draft + distinct)
    samples = []
    for _ in range(30):
        n = int(rng.integers(5, 40))
        ids = np.minimum(rng.zipf(1.3, n), distinct) + rng.integers(0, 3) * 37 - 1
        samples.append((np.clip(ids, 0, 299).astype(np.int64), (rng.random(n) < 0.7).astype(np.int64)))
    dataset = {"input_ids": [torch.as_tensor(t) for t, _ in samples],
               "loss_mask": [torch.as_tensor(m) for _, m in samples]}
    path = pre.generate_vocab_mapping_file(dataset, 300, draft, cache_dir=str(tmp_path), cache_key="v")
    ref = torch.load(path)
    d2t, t2d = vocab.draft_vocabulary(vocab.token_counts(samples), draft, 300)
    np.testing.assert_array_equal(d2t, ref["d2t"].numpy())
    np.testing.assert_array_equal(t2d, ref["t2d"].numpy())
    assert isinstance(vocab.token_counts(samples), Counter)
