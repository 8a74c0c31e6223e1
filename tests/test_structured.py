"""Structured outputs (docs/structured.md): the automaton's masks against the `regex` package's partial matching over
the demo pair's vocabulary; every kind's outputs valid (a regex fullmatch, one of the choices, JSON that `jsonschema`
validates); greedy constrained output against transformers' argmax under the oracle's mask; speculative (EAGLE-3,
prompt lookup, "auto") equal to spec-off under the same constraint; free rows beside constrained ones unchanged;
seeds, preemption, streaming; the arguments and bounds refused."""

import dataclasses
import json

import jsonschema
import numpy as np
import openai
import pytest
import regex
import torch
from transformers import Qwen3ForCausalLM

import eagle3_jax
from eagle3_jax.checkpoints.tokenizer import load_tokenizer
from eagle3_jax.decoding.automaton import Limits
from eagle3_jax.decoding.structured import Compiler, Structured, json_object_regex, target_vocabulary
from eagle3_jax.demo import PAIR

MAX_LEN, MAX_NEW = 128, 32
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"]}
KINDS = {"regex": Structured(regex=r"def [a-z_]{1,12}\((self|cls)?\):"),
         "choice": Structured(choice=["True", "False", "None"]),
         "json_schema": Structured(json_schema=SCHEMA),
         "json_object": Structured(json_object=True)}


@pytest.fixture(scope="module")
def pair():
    folder = PAIR
    target = eagle3_jax.load_target(folder / "target", dtype="float32", progress=False)
    drafter = eagle3_jax.load_drafter(folder / "drafter", target, dtype="float32")
    tokenizer = load_tokenizer(folder / "target")
    texts = [p["text"] for p in json.loads((folder / "prompts.json").read_text())[:2]]
    prompts = [tokenizer(t)["input_ids"][:24] for t in texts]
    return folder, target, drafter, tokenizer, prompts


def rows(pair):
    """Every prompt under every kind, as one request's prompts and constraints (one table shape for the request:
    its automata are laid out together) and the kind of each row."""
    kinds = [k for k in KINDS for _ in pair[4]]
    return pair[4] * len(KINDS), [KINDS[k] for k in kinds], kinds


def engine(pair, proposer, **kwargs):
    _, target, drafter, _, _ = pair
    chosen = {"off": None, "eagle3": drafter, "lookup": eagle3_jax.PromptLookup(), "auto": drafter,
              "tree": drafter}[proposer]
    auto = dict(num_draft_tokens="auto", max_draft_tokens=2,
                round_costs=lambda b, n: [1.0, 1.2, 1.3]) if proposer == "auto" else dict(num_draft_tokens=3)
    if proposer == "tree":  # a draft tree: each node masked at its automaton state down its branch
        auto = dict(num_draft_tokens=8, draft_depth=4, draft_top_k=2)
    return eagle3_jax.Engine(target, chosen, max_len=MAX_LEN, max_batch=4, **auto, **kwargs)


def decode(pair, ids) -> str:
    return pair[3].decode(ids)


def valid(kind: str, text: str) -> bool:
    """Whether a finished constrained output is what its kind asks for, by outside oracles."""
    s = KINDS[kind]
    if kind == "regex":
        return regex.fullmatch(s.regex, text) is not None
    if kind == "choice":
        return text in s.choice
    value = json.loads(text)
    if kind == "json_schema":
        jsonschema.validate(value, SCHEMA)
        return True
    return isinstance(value, dict)


# ----------------------------------------------------------------------------- the automaton


@pytest.fixture(scope="module")
def compiler(pair):
    return Compiler(target_vocabulary(pair[0] / "target", pair[1].config.vocab_size))


def token_texts(compiler):
    """Each token's text (None: a special token, or bytes that are not UTF-8 alone)."""
    out = []
    for t in compiler.vocabulary.tokens:
        try:
            out.append(None if not t else t.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(None)
    return out


@pytest.mark.parametrize("kind", ["regex", "choice", "json_schema"])
def test_masks_equal_the_regex_packages_partial_matches(compiler, kind):
    """Along a random path of allowed tokens, the tokens allowed in each state are those whose text keeps the output
    a prefix of a match (`regex`'s partial fullmatch), and the end ids where the output is a whole match."""
    s = KINDS[kind]
    pattern = regex.compile(s.to_regex())
    automaton = compiler(s)
    texts = token_texts(compiler)
    rng = np.random.default_rng(0)
    state, text = automaton.initial, ""
    for _ in range(30):
        allowed = automaton.allowed(state)
        oracle = np.array([t is not None and pattern.fullmatch(text + t, partial=True) is not None for t in texts])
        mine = allowed[: len(texts)] & np.array([t is not None for t in texts])
        assert np.array_equal(mine, oracle)
        assert all(allowed[list(automaton.eos)]) == (pattern.fullmatch(text) is not None)
        if automaton.complete[state]:
            break
        choices = np.flatnonzero(mine)
        token = int(rng.choice(choices))
        state, text = automaton.walk([token], state), text + texts[token]
    assert automaton.complete[state] or kind == "json_schema"


def test_a_cached_constraint_compiles_once(compiler):
    before = compiler.compiled
    first = compiler(Structured(choice=["yes", "no"]))
    assert compiler(Structured(choice=["yes", "no"])) is first and compiler.compiled == before + 1


BAD = [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a", 3]), "non-empty strings"),
    (dict(json_schema="{}"), "must be a dict"),
    (dict(json_object="yes"), "True or False"),
    (dict(json_schema={"type": "integer", "minimum": 3}), "'minimum', which structured outputs do not enforce"),
    (dict(json_schema={"oneOf": [{"type": "integer"}, {"type": "number"}]}), "'oneOf'"),
    (dict(json_schema={"type": "array", "uniqueItems": True}), "'uniqueItems'"),
    (dict(json_schema={"properties": {"a": {"type": "string", "not": {}}}}), r"properties\.a uses 'not'"),
    # jsonschema's metaschema check: a kept keyword's value of the wrong type is refused, not dropped from the regex
    (dict(json_schema={"type": "array", "minItems": "x"}), r"schema\.minItems is not valid JSON schema"),
    (dict(json_schema={"allOf": 5}), r"schema\.allOf is not valid JSON schema"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[str(k) for k, _ in BAD])
def test_bad_constraints_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Structured(**kwargs)


@pytest.mark.parametrize("structured, message", [
    (Structured(regex="a("), "invalid regex"),
    (Structured(regex="(?=a)b"), "does not compile to an automaton"),
    (Structured(json_schema={"type": "string", "format": "weird"}), "not supported"),
])
def test_constraints_that_do_not_compile_are_value_errors(compiler, structured, message):
    with pytest.raises(ValueError, match=message):
        compiler(structured)


@pytest.mark.parametrize("limits, message", [
    (Limits(seconds=0.2), r"more than 0.2 s to compile"),
    (Limits(table_bytes=1000), "past the 1000 allowed, refused"),
    (Limits(pairs=1000), "pairs: past the 1000 allowed"),
])
def test_a_compile_past_its_bounds_is_refused(compiler, limits, message):
    slow = Structured(regex=json_object_regex(2) if limits.seconds < 1 else "[a-z ]{1,40}")
    with pytest.raises(ValueError, match=message):
        Compiler(compiler.vocabulary, limits)(slow)


# ----------------------------------------------------------------------------- decoding


@pytest.fixture(scope="module")
def spec_off(pair):
    """Spec-off greedy output of every row of `rows`, and of the prompts free."""
    e = engine(pair, "off")
    prompts, constraints, _ = rows(pair)
    return e.generate(prompts, MAX_NEW, structured=constraints), e.generate(pair[4], MAX_NEW)


def test_greedy_is_transformers_argmax_under_the_mask(pair, spec_off):
    """The spec-off constrained output of the regex kind, token by token: the argmax of transformers' float32
    logits over the tokens the `regex` package's partial matching allows (the end id where the text matches)."""
    folder, _, _, tokenizer, prompts = pair
    model = Qwen3ForCausalLM.from_pretrained(folder / "target", dtype=torch.float32).eval()
    pattern = regex.compile(KINDS["regex"].regex)
    texts = [None] * model.config.vocab_size
    for i in range(len(tokenizer)):
        texts[i] = tokenizer.decode([i])
    eos = tokenizer.eos_token_id
    ids, out, text = list(prompts[0]), [], ""
    while len(out) < MAX_NEW:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].numpy()
        ok = np.array([t is not None and i != eos and pattern.fullmatch(text + t, partial=True) is not None
                       for i, t in enumerate(texts)])
        ok[eos] = pattern.fullmatch(text) is not None
        token = int(np.argmax(np.where(ok, logits, -np.inf)))
        if token == eos:
            break
        out.append(token)
        ids.append(token)
        text += texts[token]
    result = spec_off[0][0]
    assert result.token_ids == out and result.finish_reason == ("stop" if len(out) < MAX_NEW else "length")


@pytest.mark.parametrize("proposer", ["eagle3", "lookup", "auto", "tree"])
def test_speculation_equals_spec_off_and_every_output_is_valid(pair, spec_off, proposer):
    prompts, constraints, kinds = rows(pair)
    got = engine(pair, proposer).generate(prompts, MAX_NEW, structured=constraints)
    assert [r.token_ids for r in got] == [r.token_ids for r in spec_off[0]]
    finished = 0
    for kind, r in zip(kinds, got):
        text = decode(pair, r.token_ids)
        if r.finish_reason == "stop":
            finished += 1
            assert valid(kind, text), (kind, text)
        else:
            assert regex.compile(KINDS[kind].to_regex()).fullmatch(text, partial=True) is not None
            assert len(r.token_ids) == MAX_NEW
    assert finished >= 4


def test_free_rows_beside_constrained_rows_are_unchanged_and_streams_agree(pair, spec_off):
    """Every other row free, streamed: each row's streamed tokens are its spec-off output, alone or constrained."""
    prompts, constraints, _ = rows(pair)
    mixed = [None if i % 2 else c for i, c in enumerate(constraints)]
    streamed = [[] for _ in mixed]
    for i, tokens in engine(pair, "eagle3").stream(prompts, MAX_NEW, structured=mixed):
        streamed[i] += tokens
    for i, tokens in enumerate(streamed):
        assert tokens == (spec_off[1][i % len(pair[4])] if i % 2 else spec_off[0][i]).token_ids


def test_unconstrained_drafts_are_lossless(pair, spec_off):
    """constrain_drafts=False: the JSON-schema rows (whose drafts the mask changes most) equal spec-off's."""
    prompts, constraints, kinds = rows(pair)
    rows_ = [i for i, k in enumerate(kinds) if k == "json_schema"]
    got = engine(pair, "eagle3", constrain_drafts=False).generate([prompts[i] for i in rows_], MAX_NEW,
                                                                  structured=[constraints[i] for i in rows_])
    assert [r.token_ids for r in got] == [spec_off[0][i].token_ids for i in rows_]


def test_sampled_rows_are_valid_and_seeds_reproduce(pair):
    """One row of each kind, Qwen3's settings (the candidate filter's build), twice with the same seeds."""
    kinds = list(KINDS)
    e = engine(pair, "eagle3", proposal="sample")
    settings = dict(temperature=0.6, top_k=20, top_p=0.95, seed=[5, 6, 7, 8], structured=[KINDS[k] for k in kinds])
    first = e.generate(pair[4][:1] * 4, MAX_NEW, **settings)
    assert [r.token_ids for r in e.generate(pair[4][:1] * 4, MAX_NEW, **settings)] == [r.token_ids for r in first]
    for kind, r in zip(kinds, first):
        text = decode(pair, r.token_ids)
        assert valid(kind, text) if r.finish_reason == "stop" else \
            regex.compile(KINDS[kind].to_regex()).fullmatch(text, partial=True) is not None


def test_a_preempted_row_rebuilds_its_constraint_state(pair, spec_off):
    """KV for one whole sequence and four slots: rows are preempted and recomputed from their emitted tokens,
    their automaton states walked over them on the host."""
    prompts, constraints, _ = rows(pair)
    e = engine(pair, "eagle3", kv_tokens=MAX_LEN, page_size=8)
    got = e.generate(prompts, MAX_NEW, structured=constraints)
    assert e.preemptions > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in spec_off[0]]


def test_a_target_without_a_tokenizer_is_refused(tmp_path, pair):
    target = pair[1]
    bare = eagle3_jax.Engine(dataclasses.replace(target, folder=tmp_path), max_len=MAX_LEN)
    with pytest.raises(ValueError, match="need the target's tokenizer"):
        bare.generate(pair[4][:1], 4, structured=KINDS["choice"])
    with pytest.raises(ValueError, match="structured has 3 values for 2 prompts"):
        engine(pair, "off").generate(pair[4], 4, structured=[None, KINDS["choice"], None])
    with pytest.raises(ValueError, match="must be an eagle3_jax.Structured"):
        engine(pair, "off").generate(pair[4], 4, structured={"regex": "a"})


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def client(pair):
    """The app over a live pool of the demo pair (EAGLE-3, gamma 3), in process, driven by the `openai` client through
    Starlette's test client (an httpx client); the demo tokenizer with a small chat template."""
    from starlette.testclient import TestClient

    from eagle3_jax.decoding.live import LivePool
    from eagle3_jax.serving.app import ServerState, build_app

    folder, _, _, _, _ = pair
    tokenizer = load_tokenizer(folder / "target")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    pool = LivePool(engine(pair, "eagle3"))
    state = ServerState(pool, tokenizer, "demo", {"temperature": 0.0, "top_k": 0, "top_p": 1.0}, (0,))
    with TestClient(build_app(state)) as http:
        # the offline oracle: another engine of the same configuration (one pool runs on an engine at a time)
        yield (openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0),
               engine(pair, "eagle3"))
    pool.close()


SERVED = [  # (endpoint, the request's constraint fields, the kind its text must be)
    ("completions", {"structured_outputs": {"regex": KINDS["regex"].regex}}, "regex"),
    ("completions", {"structured_outputs": {"choice": list(KINDS["choice"].choice)}}, "choice"),
    ("chat", {"structured_outputs": {"json": SCHEMA}}, "json_schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA,
                                                                         "strict": True}}}, "json_schema"),
    ("completions", {"response_format": {"type": "json_object"}}, "json_object"),
]


@pytest.mark.parametrize("endpoint, fields, kind", SERVED, ids=[f"{e}-{k}" for e, _, k in SERVED])
def test_the_server_serves_every_kind(client, pair, endpoint, fields, kind):
    api, e = client
    prompt = decode(pair, pair[4][0])
    if endpoint == "completions":
        response = api.completions.create(model="demo", prompt=prompt, max_tokens=MAX_NEW, extra_body=fields)
        text, reason = response.choices[0].text, response.choices[0].finish_reason
        ids = pair[3](prompt)["input_ids"]
    else:
        response = api.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=MAX_NEW, extra_body=fields)
        text, reason = response.choices[0].message.content, response.choices[0].finish_reason
        ids = pair[3](prompt + "\n", add_special_tokens=False)["input_ids"]
    (offline,) = e.generate([ids], MAX_NEW, stop_token_ids=[0], structured=KINDS[kind])
    assert text == decode(pair, offline.token_ids) and reason == offline.finish_reason
    assert valid(kind, text) if reason == "stop" else \
        regex.compile(KINDS[kind].to_regex()).fullmatch(text, partial=True) is not None


@pytest.mark.parametrize("fields, message", [
    ({"structured_outputs": {"regex": "a("}}, "invalid regex"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 1}}}, "'minimum'"),
    ({"structured_outputs": {"choice": []}}, "non-empty list"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
    ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"allOf": 5}}}},
     "not valid JSON schema"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}}, "give type json_schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
])
def test_bad_constraints_get_400(client, fields, message):
    api, _ = client
    with pytest.raises(openai.BadRequestError, match=message):
        api.completions.create(model="demo", prompt="x", max_tokens=4, extra_body=fields)
    assert api.completions.create(model="demo", prompt="x", max_tokens=2).choices[0].text is not None


# ----------------------------------------------------------------------------- the constrained sampler's distribution

CHI_REGEX = "[a-e][b-g][a-c]+"  # tokens are single letters: a-e, then b-g, then a-c (no end within three tokens)
CHI_SETTINGS = (0.9, 3, 0.9)  # temperature, top_k, top_p: the filters act on the masked logits
CHI_N = 20_000


@pytest.fixture(scope="module")
def tiny_lettered(tmp_path_factory):
    """test_sampling_engine's 16-token target and drafter, the target with a byte-level tokenizer whose token i is
    the letter chr(ord('a') + i) (15 is the end of sequence)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from test_sampling_engine import tiny

    model, target, drafter = tiny.__wrapped__(tmp_path_factory)
    vocab = {chr(ord("a") + i): i for i in range(15)} | {"<e>": 15}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(["<e>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<e>").save_pretrained(target.folder)
    return model, target, drafter


def exact_masked_first_three(model) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] in float64: the target's logits masked to CHI_REGEX's letters at each position, then
    transformers' warpers (test_sampling_engine.oracle_probs), enumerated."""
    from test_sampling_engine import PROMPT, V, oracle_probs

    allowed = [range(0, 5), range(1, 7), range(0, 3)]

    def next_probs(prefixes, step):
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1]
        masked = torch.full_like(logits, -torch.inf)
        masked[:, list(allowed[step])] = logits[:, list(allowed[step])]
        return oracle_probs(masked, *CHI_SETTINGS)

    p1 = next_probs([PROMPT], 0)[0]
    p2 = next_probs([PROMPT + [a] for a in range(V)], 1)
    p3 = next_probs([PROMPT + [a, b] for a in range(V) for b in range(V)], 2).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def constrained_samples(tiny, seed0: int) -> np.ndarray:
    from test_sampling_engine import PROMPT

    _, target, drafter = tiny
    e = eagle3_jax.Engine(target, drafter, num_draft_tokens=2, max_len=8, proposal="sample", rounds_per_call=1,
                          max_batch=CHI_N, prefill_chunk=len(PROMPT) * CHI_N, prefill_sequences=CHI_N)
    t, k, p = CHI_SETTINGS
    results = e.generate([PROMPT] * CHI_N, 3, temperature=t, top_k=k, top_p=p, seed=list(range(seed0, seed0 + CHI_N)),
                         structured=Structured(regex=CHI_REGEX))
    return np.array([r.token_ids for r in results])


def test_constrained_samples_follow_the_exact_masked_distribution(tiny_lettered):
    from test_sampling_engine import gate_p_value

    assert gate_p_value(constrained_samples(tiny_lettered, 100), exact_masked_first_three(tiny_lettered[0])) > 1e-4


def test_the_gate_rejects_an_unmasked_sampler(tiny_lettered, monkeypatch):
    """The same samples with the target's mask taken out of prefill and the rounds (the drafts still masked)."""
    from eagle3_jax.decoding import engine as engine_lib
    from eagle3_jax.decoding import grammar

    from test_sampling_engine import gate_p_value

    monkeypatch.setattr(grammar, "mask", lambda tables, table, states, logits: logits)
    engine_lib.jit_rounds.clear_cache()
    engine_lib.jit_prefill.clear_cache()
    try:
        tokens = constrained_samples(tiny_lettered, 100)
    finally:
        monkeypatch.undo()
        engine_lib.jit_rounds.clear_cache()
        engine_lib.jit_prefill.clear_cache()
    assert gate_p_value(tokens, exact_masked_first_three(tiny_lettered[0])) < 1e-6
