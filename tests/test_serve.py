"""`eagle3-jax serve` run as a user runs it, on 127.0.0.1, driven by the official `openai` client: every answer
equals offline `Engine.generate` decoded, with its usage and acceptance; bad requests get OpenAI-style errors
and the server keeps serving; an abandoned stream is aborted; signals drain; a bounded load loses nothing.

The checkpoint is the permutation world (tests/spec_worlds.py) with the pi2 drafter, whose first draft of every
round is accepted and second never: acceptance is known exactly. Its tokenizer is a word-level one (token i is
the word "wi", w47 the end of sequence) with a small chat template."""

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import eagle3_jax
from eagle3_jax.cli import main
from eagle3_jax.serving.server import OPENAI_DEFAULTS, request_defaults

import spec_worlds as worlds
from test_outputs import SETTINGS, TOLERANCE, oracle_logprobs, reference

MAX_LEN, GAMMA, EOS = 64, 2, 47
ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %} w4{% endif %}")


def save_tokenizer(folder: Path) -> None:
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(worlds.V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{EOS}", unk_token="w0")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)


def save_world(root: Path, target_world: str, drafter_world: str):
    """A 4-layer target of `target_world` with the word tokenizer in root/target, its drafter in root/drafter;
    returns the target's transformers model."""
    model, target = worlds.save_target(target_world, root / "target", layers=4)
    worlds.save_drafter(drafter_world, root / "drafter", target)
    save_tokenizer(root / "target")
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    save_world(root, "permutation", "pi2")
    return root


class Server:
    """An `eagle3-jax serve` subprocess on a free port of 127.0.0.1."""

    def __init__(self, folders: Path, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        # The module's servers share one persistent compilation cache (beside the checkpoints): the first start of a
        # configuration compiles its programs ahead, every later start of it loads them.
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "EAGLE3_JAX_COMPILE_CACHE": str(folders / "xla"), "JAX_PLATFORMS": "cpu"}
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: an unread pipe could fill and stall it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eagle3_jax.cli", "serve", "--target", str(folders / "target"), "--drafter",
             str(folders / "drafter"), "--num-draft-tokens", str(GAMMA), "--max-len", str(MAX_LEN), "--port",
             str(self.port), "--served-model-name", "tiny", *flags], env=env, stdout=self.log,
            stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError("the server did not become healthy")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def rss(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) * 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def server(folders):
    s = Server(folders, "--max-batch", "8")
    yield s
    s.stop()


def test_a_second_start_compiles_nothing(folders, server):
    """The module's server compiled every program of its pool ahead (the greedy build's and the sampling build its
    defaults take) into the shared persistent cache; a second start of the same configuration compiles nothing,
    ahead or while it serves greedy and default-sampled requests (JAX's compile events, its /metrics)."""
    assert int(re.search(r"compiled (\d+) programs ahead", server.output()).group(1)) > 0
    again = Server(folders, "--max-batch", "8")
    try:
        assert "compiled 0 programs ahead" in again.output()
        client = again.client()
        for temperature in (0.0, None):
            text = client.completions.create(model="tiny", prompt="w5 w9 w11", max_tokens=12, seed=3,
                                             **({} if temperature is None else {"temperature": temperature}))
            assert text.choices[0].text
        assert again.metric("eagle3_jax_backend_compilations_total") == 0
    finally:
        again.stop()


@pytest.fixture(scope="module")
def offline(folders):
    """Offline generation on the same checkpoint, as the oracle: (tokens, accept lengths) per prompt."""
    target = eagle3_jax.load_target(folders / "target", dtype="float32", progress=False)
    drafter = eagle3_jax.load_drafter(folders / "drafter", target, dtype="float32")
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=GAMMA, max_len=MAX_LEN, max_batch=8)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folders / "target")

    def run(prompts, budgets, stops=(EOS,)):
        results = engine.generate(prompts, budgets, list(stops))
        return [(r.token_ids, r.accept_lengths, tokenizer.decode(r.token_ids, skip_special_tokens=True),
                 r.finish_reason) for r in results]

    run.tokenizer, run.engine = tokenizer, engine
    return run


def words(ids):
    return " ".join(f"w{i}" for i in ids)


def check_usage(usage, prompt_len, tokens, accepts):
    assert usage.prompt_tokens == prompt_len and usage.completion_tokens == len(tokens)
    assert usage.total_tokens == prompt_len + len(tokens)
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens == sum(accepts) > 0
    assert details.rejected_prediction_tokens == GAMMA * len(accepts) - sum(accepts)


def test_text_token_ids_chat_and_streams_equal_offline_generation(server, offline):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = [3, 17, int(worlds.ORDER[(worlds.ORDER.tolist().index(EOS) - 12) % worlds.V])]  # w47 13th
    ((tokens, accepts, text, reason),) = offline([prompt], 40)
    assert reason == "stop" and tokens[-1] == EOS  # the eos stops it, and is not in the text
    got = client.completions.create(model="tiny", prompt=words(prompt), max_tokens=40, temperature=0)
    assert got.choices[0].text == text and got.choices[0].finish_reason == "stop"
    check_usage(got.usage, 3, tokens, accepts)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=40)  # generation_config.json: greedy
    assert got.choices[0].text == text
    ((long, _, long_text, _),) = offline([prompt], 40, stops=())
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == long_text and got.usage.completion_tokens == 40 and len(long_text) > len(text)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text and len(chunks) > 3
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].choices == []
    check_usage(chunks[-1].usage, 3, tokens, accepts)
    for thinking, extra in ((None, []), (False, [4])):
        chat_prompt = offline.tokenizer(f"w1 w5 w6 w2 w3{' w4' if extra else ''}")["input_ids"]
        ((tokens, accepts, text, _),) = offline([chat_prompt], 30)
        kwargs = {} if thinking is None else {"extra_body": {"chat_template_kwargs": {"enable_thinking": thinking}}}
        got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w6"}],
                                             max_tokens=30, temperature=0, **kwargs)
        assert got.choices[0].message.content == text and got.choices[0].message.role == "assistant"
        check_usage(got.usage, len(chat_prompt), tokens, accepts)
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w6"}],
                                                max_tokens=30, temperature=0, stream=True, **kwargs)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == text


def test_a_seeded_sampled_request_equals_its_offline_run(server, offline):
    """Temperature 2 flattens the permutation target's distribution: the draws, not the argmax, decide."""
    prompt, settings = [7, 11], dict(temperature=2.0, top_p=0.9, seed=5)
    (want,) = offline.engine.generate([prompt], 30, [EOS], **settings)
    ((greedy, _, _, _),) = offline([prompt], 30)
    assert want.token_ids != greedy
    got = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=30, **settings)
    assert got.choices[0].text == offline.tokenizer.decode(want.token_ids, skip_special_tokens=True)
    assert got.usage.completion_tokens == len(want.token_ids)


def test_stop_strings_across_tokens_and_stop_token_ids(server, offline):
    client = server.client()
    prompt = [9, 30]
    ((tokens, _, text, _),) = offline([prompt], 30, stops=())
    stop = " ".join(text.split()[3:5])[1:]  # the end of the 4th word, a space and the start of the 5th
    cut = text[: text.index(stop)]
    for stream in (False, True):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stream=stream,
                                        stop=[stop, "never here"], extra_body={"ignore_eos": True})
        if stream:
            chunks = list(got)
            assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"
        else:  # usage counts the tokens up to the 5th, which completes the stop string, none past it
            assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
            assert got.usage.completion_tokens == 5
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                                    extra_body={"stop_token_ids": [tokens[6]], "ignore_eos": True})
    ((_, _, want, _),) = offline([prompt], 30, stops=(tokens[6],))
    assert got.choices[0].text == want and got.usage.completion_tokens == 7


def test_sixteen_concurrent_clients(server, offline):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, worlds.V, size=int(n)).tolist() for n in rng.integers(1, 12, size=16)]
    budgets = rng.integers(1, 40, size=16).tolist()
    expected = offline(prompts, budgets)

    def one(i):
        client = server.client()
        if i % 2:
            chunks = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=budgets[i],
                                               temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model="tiny", prompt=words(prompts[i]), max_tokens=budgets[i],
                                         temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(16))) == [text for _, _, text, _ in expected]


BAD = [  # (body, status, part of the message)
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": "many"}, 400, "max_tokens"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"seed": -1}, 400, "seed"),
    ({"max_tokens": 62, "prompt": [1, 2, 3]}, 400, "the prompt has 3 tokens and max_tokens is 62"),
    ({"prompt": [1, 2, 48]}, 400, "token id 48 outside the vocabulary"),
    ({"prompt": ""}, 400, "the prompt is empty"),
    ({"prompt": []}, 400, "the prompt is empty"),
    ({"n": 17}, 400, "n: Input should be less than or equal to 16"),
    ({"n": 0}, 400, "n: Input should be greater than or equal to 1"),
    ({"prompt": [[1]] * 20, "n": 13}, 400, "at most 256 choices (prompts x n), got 20 prompts x n 13"),
    ({"prompt": [1, "w2"]}, 400, "prompt must be a string, a list of strings, a list of token ids or a list of"),
    ({"prompt": [[1], []]}, 400, "the prompt is empty"),
    ({"stop_token_ids": list(range(9))}, 400, "at most 8 stop token ids"),
    ({"model": "other"}, 404, "the model `other` does not exist"),
    # Fields that would change the output and that the server does not honour: refused, never ignored.
    ({"best_of": 3}, 400, "`best_of` > 1"),
    ({"suffix": " w9"}, 400, "`suffix`"),
    ({"guided_json": {"type": "object"}}, 400, "`guided_json` (vLLM's older name) is not served"),
    ({"guided_regex": "w1+"}, 400, "`guided_regex`"),
    ({"guided_choice": ["w1"]}, 400, "`guided_choice`"),
    ({"guided_grammar": "root ::= 'w1'"}, 400, "`guided_grammar`"),
    ({"min_p": 0.1}, 400, "`min_p`"),
    ({"min_tokens": 3}, 400, "`min_tokens`"),
    ({"prompt_logprobs": 1}, 400, "`prompt_logprobs`"),
    ({"skip_special_tokens": False}, 400, "`skip_special_tokens` is not a field this server honours"),
    ({"frobnicate": 1}, 400, "`frobnicate` is not a field this server honours"),
    ({"stream_options": {"include_usage": True, "continuous": True}}, 400, "stream_options.continuous"),
]


@pytest.mark.parametrize("body, status, message", BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, message):
    request = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, **body}
    response = httpx.post(server.url + "/v1/completions", json=request)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == status
    if len(body) == 1 and next(iter(body)) not in ("prompt", "max_tokens"):  # the field at fault is named
        assert error["param"] == next(iter(body))
    assert server.client().completions.create(model="tiny", prompt=[1], max_tokens=2).usage.completion_tokens >= 1


CHAT_BAD = [  # (body, the field named)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"functions": [{"name": "f"}], "function_call": "auto"}, "function_call"),
    ({"echo": True}, "echo"),
]


@pytest.mark.parametrize("body, field", CHAT_BAD)
def test_chat_refuses_what_it_cannot_honour(server, body, field):
    request = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 4, **body}
    response = httpx.post(server.url + "/v1/chat/completions", json=request)
    assert response.status_code == 400 and response.json()["error"]["param"] == field
    assert f"`{field}`" in response.json()["error"]["message"]


def test_fields_that_change_nothing_are_accepted(server, offline):
    """user, metadata and store change no output; tools with tool_choice "none" reach the chat template (this
    one renders none of them) and change nothing here either."""
    ((_, _, text, _),) = offline([[3, 17]], 6)
    got = httpx.post(server.url + "/v1/completions", json={
        "model": "tiny", "prompt": [3, 17], "max_tokens": 6, "temperature": 0, "user": "u1", "store": False,
        "metadata": {"k": "v"}, "best_of": 1, "suffix": "", "response_format": {"type": "text"}, "min_p": 0})
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == text
    chat_prompt = offline.tokenizer("w1 w5 w2 w3")["input_ids"]
    ((_, _, text, _),) = offline([chat_prompt], 6)
    got = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=6, temperature=0, user="u1",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], tool_choice="none")
    assert got.choices[0].message.content == text


def test_unknown_models_paths_and_methods_get_openai_errors(server):
    assert httpx.get(server.url + "/v1/models/tiny").json() == {"id": "tiny", "object": "model", "created": 0,
                                                                "owned_by": "eagle3-jax"}
    for method, path, status, message in [("GET", "/v1/models/gpt-4", 404, "the model `gpt-4` does not exist"),
                                          ("GET", "/v1/completions", 405, "GET is not allowed on /v1/completions"),
                                          ("DELETE", "/v1/models", 405, "DELETE is not allowed on /v1/models"),
                                          ("POST", "/v1/embeddings", 404, "there is no /v1/embeddings")]:
        response = httpx.request(method, server.url + path)
        assert response.status_code == status and message in response.json()["error"]["message"]
        assert response.json()["error"]["code"] == status
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        server.client().models.retrieve("gpt-4")


def test_a_body_not_json_or_not_labelled_json_is_refused_saying_so(server):
    body = b'{"model": "tiny", "prompt": [1], "max_tokens": 2}'
    for headers, message in [({"content-type": "text/plain"}, "the body must be JSON, sent with 'Content-Type: "
                                                              "application/json' (got 'text/plain')"),
                             ({}, "(got 'no content type')")]:
        response = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
        assert response.status_code == 400 and message in response.json()["error"]["message"]
    response = httpx.post(server.url + "/v1/chat/completions", data={"model": "tiny"})  # a form
    assert response.status_code == 400 and "application/x-www-form-urlencoded" in response.json()["error"]["message"]
    response = httpx.post(server.url + "/v1/completions", json=[1, 2])
    assert response.status_code == 400 and "a JSON object, got list" in response.json()["error"]["message"]
    response = httpx.post(server.url + "/v1/completions", content=b"\xff\xfe", headers={"content-type":
                                                                                      "application/json"})
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/completions", content=body, headers={
        "content-type": "application/json; charset=utf-8"}).status_code == 200


def test_n_prompt_lists_and_token_id_lists(server, offline):
    """Choices are prompt-major with OpenAI's index (prompt i's j-th is i n + j), usage sums every choice (each
    prompt's tokens once); numeric strings are text, not token ids."""
    client = server.client()
    prompts = [[3, 17], [9, 30, 2], [5]]
    expected = offline(prompts, 8)
    for prompt in ([words(p) for p in prompts], prompts):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, n=2)
        assert [c.index for c in got.choices] == list(range(6))
        assert [c.text for c in got.choices] == [text for _, _, text, _ in expected for _ in range(2)]
        assert got.usage.prompt_tokens == 6 and got.usage.completion_tokens == 2 * sum(len(t) for t, *_ in expected)
        details = got.usage.completion_tokens_details
        assert details.accepted_prediction_tokens == 2 * sum(sum(a) for _, a, _, _ in expected)
    chunks = list(client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    texts, reasons = [""] * 6, [None] * 6
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [text for _, _, text, _ in expected for _ in range(2)] and None not in reasons
    assert chunks[-1].usage.completion_tokens == 2 * sum(len(t) for t, *_ in expected)
    numeric = client.completions.create(model="tiny", prompt=["12", "34"], max_tokens=4, temperature=0)
    as_text = offline([offline.tokenizer("12")["input_ids"], offline.tokenizer("34")["input_ids"]], 4)
    assert [c.text for c in numeric.choices] == [text for _, _, text, _ in as_text]
    assert numeric.usage.prompt_tokens == 2  # each an unknown word, not the ids 12 and 34 ...
    as_ids = offline([[12], [34]], 4)
    assert [text for _, _, text, _ in as_ids] != [text for _, _, text, _ in as_text]  # ... which decode otherwise


def test_seeded_n_gives_distinct_reproducible_streams(server, offline):
    """Choice j of a seeded request samples with seed + j: the n streams differ, a repeat gives them again, and each
    is the n=1 request's at its seed (for chat too)."""
    client = server.client()
    settings = dict(temperature=2.0, seed=5)
    got = client.completions.create(model="tiny", prompt=[7, 11], max_tokens=12, n=3, **settings)
    texts = [c.text for c in got.choices]
    assert len(set(texts)) == 3
    assert [c.text for c in client.completions.create(model="tiny", prompt=[7, 11], max_tokens=12, n=3,
                                                      **settings).choices] == texts
    for j in range(3):
        (want,) = offline.engine.generate([[7, 11]], 12, [EOS], temperature=2.0, seed=5 + j)
        assert texts[j] == offline.tokenizer.decode(want.token_ids, skip_special_tokens=True)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=12,
                                          n=2, **settings)
    alone = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}],
                                           max_tokens=12, temperature=2.0, seed=6)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[1].message.content == alone.choices[0].message.content
    assert chat.choices[0].message.content != chat.choices[1].message.content


def test_usage_counts_drafts_past_a_stop_string_as_rejected(folders):
    """A round's tokens are its accepted drafts then the target's own: when a stop string ends the text inside the
    accepted drafts, the drafts after it count as rejected, so accepted + rejected stays the drafted count and
    accepted never exceeds the completion's tokens after its first (a pool that reports known events)."""
    import asyncio

    from eagle3_jax.decoding.live_plan import Event
    from eagle3_jax.serving.app import Generation, ServerState

    class Pool:
        error, engine = None, None
        aborted: list = []

        def check(self, **settings):
            return settings

        def submit(self, row, deliver):
            for event in (Event(0, [5], 0, 0, False, None), Event(0, [6, 7, 8, 9], 3, 3, False, None, 3),
                          Event(0, [10, 11], 1, 3, True, "length", 3)):
                deliver(event)
            return 0

        def abort(self, request_id):
            self.aborted.append(request_id)

    state = ServerState(Pool(), PreTrainedTokenizerFast.from_pretrained(folders / "target"), "tiny", {}, ())
    run = Generation(state, 0, {"prompt": [1, 2]}, ["w6"])

    async def text():
        return "".join([piece.text async for piece in run.pieces()])

    assert asyncio.run(text()) == "w5 " and run.finish_reason == "stop" and state.pool.aborted == [0]
    assert (run.usage.completion_tokens, run.usage.accepted, run.usage.drafted) == (2, 1, 3)


def test_malformed_json_and_the_clients_errors(server):
    response = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().completions.create(model="tiny", prompt=[1], temperature=7)
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "w1"}])
    with pytest.raises(openai.BadRequestError, match="best_of"):
        server.client().completions.create(model="tiny", prompt=[1], best_of=2, n=1)
    assert httpx.get(server.url + "/health").status_code == 200


def test_an_abandoned_stream_is_aborted(server):
    """A client that goes away after its first chunk, among seven others that run to their end."""
    aborted = server.metric('eagle3_jax_requests_finished_total{finish_reason="abort"}')
    body = {"model": "tiny", "prompt": [5], "max_tokens": 60, "temperature": 0, "stream": True, "ignore_eos": True}

    def whole(_):
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            return sum(1 for line in response.iter_lines() if line.startswith("data: {"))

    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        others = pool.map(whole, range(7))
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            next(response.iter_lines())  # the first chunk, then the client goes away
        assert all(n > 2 for n in others)
    deadline = time.monotonic() + 30
    while server.metric("eagle3_jax_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("eagle3_jax_requests_running") == 0
    assert server.metric('eagle3_jax_requests_finished_total{finish_reason="abort"}') == aborted + 1
    text = httpx.get(server.url + "/metrics").text
    for name in ("requests_waiting", "spec_draft_tokens_total", "spec_accepted_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count",
                 "generation_tokens_total"):
        assert f"eagle3_jax_{name}" in text
    assert server.metric("eagle3_jax_spec_accepted_tokens_total") > 0


def test_load_of_200_requests_from_32_clients(server, offline):
    """Mixed prompt lengths and budgets, half streamed: every answer equals its offline run, and the server's
    memory stays flat once the first round of the same workload has run."""
    rng = np.random.default_rng(1)
    count = 200
    prompts = [rng.integers(0, worlds.V, size=int(n)).tolist() for n in rng.integers(1, 24, size=count)]
    budgets = rng.integers(1, 40, size=count).tolist()
    expected = [text for _, _, text, _ in offline(prompts, budgets)]
    client = server.client()

    def one(i):
        if i % 2:
            chunks = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=budgets[i],
                                               temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=budgets[i],
                                         temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(40))) == expected[:40]  # the warm-up
        warm = server.rss()
        assert list(pool.map(one, range(count))) == expected
    grown = server.rss() - warm
    assert grown < 32 * 2**20, f"the server grew by {grown / 2**20:.1f} MiB over the load"
    assert server.metric("eagle3_jax_requests_running") == 0 and server.metric("eagle3_jax_requests_waiting") == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_key_and_signals_drain_requests_in_flight(folders, sig):
    """SIGTERM lets the running requests finish (--drain-s) and refuses new ones; SIGINT aborts them at once (a
    request may still finish while the signal is on its way). Either way the server exits 0."""
    server = Server(folders, "--max-batch", "1", "--api-key", "secret", "--drain-s", "60")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").models.list()
        assert httpx.post(server.url + "/v1/completions", json={}).status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        client = server.client("secret")
        body = dict(model="tiny", prompt=[5], max_tokens=60, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        streams = [client.completions.create(**body) for _ in range(6)]  # one slot: five of them wait
        first = [next(iter(streams[0]))]
        server.proc.send_signal(sig)
        if sig == signal.SIGTERM:  # refused once the signal is handled (the first may come before)
            for _ in range(100):
                refused = httpx.post(server.url + "/v1/completions", headers={"authorization": "Bearer secret"},
                                     json={"model": "tiny", "prompt": [1], "max_tokens": 2}, timeout=60)
                if refused.status_code != 200:
                    break
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            health = httpx.get(server.url + "/health")  # a load balancer stops sending
            assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
        ends = [(chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens)
                for chunks in [first + list(streams[0])] + [list(s) for s in streams[1:]]]
        if sig == signal.SIGTERM:
            assert ends == [("length", 60)] * 6
        else:  # what had not finished when the signal was handled is aborted at once, in order, the last surely
            assert all(end == ("length", 60) or (end[0] == "abort" and end[1] < 60) for end in ends)
            aborted = [end[0] == "abort" for end in ends]
            assert aborted[-1] and aborted == sorted(aborted)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_serve_refuses_bad_arguments_before_loading(folders, capsys):
    assert main(["serve", "--target", str(folders / "drafter")]) == 2
    assert "has no tokenizer: the server needs one" in capsys.readouterr().err
    for flags, message in [(["--drain-s", "-1"], "--drain-s must be >= 0"),
                           (["--num-draft-tokens", "auto"], "pass --drafter or --prompt-lookup"),
                           (["--prompt-lookup-max", "2"], "are for --prompt-lookup"),
                           (["--max-draft-tokens", "2"], "--max-draft-tokens is for --num-draft-tokens auto")]:
        with pytest.raises(SystemExit, match=message):
            main(["serve", "--target", str(folders / "target"), *flags])


def test_omitted_settings_come_from_generation_config_else_openais_temperature_1(tmp_path):
    assert request_defaults(tmp_path) == OPENAI_DEFAULTS == {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6, "top_k": 20}')
    assert request_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20, "top_p": 1.0}
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}')  # no do_sample: greedy
    assert request_defaults(tmp_path)["temperature"] == 0.0


# The random world, for values worth checking: transformers' float32 forward of its target is the oracle of
# logprobs, and of penalties applied greedily (tests/test_outputs.py's reference).


@pytest.fixture(scope="module")
def random_world(tmp_path_factory):
    """(folders, the target's transformers model in float32): the random target and drafter, the word tokenizer."""
    root = tmp_path_factory.mktemp("serve_random")
    return root, save_world(root, "random", "random").float()


@pytest.fixture(scope="module")
def oracle_server(random_world):
    """Speculative (gamma 2) over the random world, pages of 8 tokens (prompts longer than one hit the cache)."""
    s = Server(random_world[0], "--max-batch", "4", "--page-size", "8")
    yield s
    s.stop()


def check_completion_logprobs(logprobs, model, prompt, tokens, k, echo=False):
    """OpenAI's legacy shape against the oracle: each token's text and logprob, a dict of the k most likely tokens'
    texts and the chosen one's (None for an echoed prompt's first), offsets the running sum of the texts."""
    lp = oracle_logprobs(model, prompt + tokens)
    shown = (prompt if echo else []) + tokens
    assert logprobs.tokens == [f"w{t}" for t in shown]
    assert logprobs.text_offset == [sum(len(f"w{t}") for t in shown[:i]) for i in range(len(shown))]
    positions = range(1, len(prompt) + len(tokens)) if echo else range(len(prompt), len(prompt) + len(tokens))
    if echo:
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for got, top, at in zip(logprobs.token_logprobs[int(echo):], logprobs.top_logprobs[int(echo):], positions):
        row, token = lp[at - 1], (prompt + tokens)[at]
        assert abs(got - row[token]) < TOLERANCE
        best = np.argsort(-row, kind="stable")[:k].tolist()
        assert set(top) == {f"w{t}" for t in best + [token]}
        assert all(abs(v - row[int(name[1:])]) < TOLERANCE for name, v in top.items())
        assert max(top.values()) == pytest.approx(row.max(), abs=TOLERANCE)


def test_logprobs_equal_transformers_whole_and_streamed(oracle_server, random_world):
    client, model = oracle_server.client(), random_world[1]
    prompt = [3, 17, 5, 9]
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=5,
                                    extra_body={"ignore_eos": True})
    tokens = [int(w[1:]) for w in got.choices[0].logprobs.tokens]
    assert tokens == reference(model, prompt, 10)
    check_completion_logprobs(got.choices[0].logprobs, model, prompt, tokens, 5)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=5,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    assert len(streamed) > 2  # a chunk per call, each with its own tokens' logprobs
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(x, field) for x in streamed), []) == getattr(got.choices[0].logprobs, field)
    chat_prompt = PreTrainedTokenizerFast.from_pretrained(random_world[0] / "target")("w1 w5 w6 w2 w3")["input_ids"]
    for stream in (False, True):
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w6"}],
                                              max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                                              stream=stream, extra_body={"ignore_eos": True})
        content = [e for c in chat for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])] \
            if stream else chat.choices[0].logprobs.content
        tokens = [int(e.token[1:]) for e in content]
        lp = oracle_logprobs(model, chat_prompt + tokens)
        assert tokens == reference(model, chat_prompt, 8)
        for i, (e, token) in enumerate(zip(content, tokens)):
            row = lp[len(chat_prompt) - 1 + i]
            assert abs(e.logprob - row[token]) < TOLERANCE and e.bytes == list(e.token.encode())
            assert [x.token for x in e.top_logprobs] == [f"w{t}" for t in np.argsort(-row, kind="stable")[:3]]


def test_echo_with_prompt_logprobs_is_lm_evals_loglikelihood(oracle_server, random_world):
    """max_tokens 1, logprobs 1, echo, temperature 0 (lm-evaluation-harness's request), for a prompt whose first
    pages the cache holds from a request before: its logprobs are still computed whole (the prompt bypasses the
    cache), as text, token ids and batches of each (as lm-eval sends them)."""
    client, model = oracle_server.client(), random_world[1]
    prompt = [(7 * i + 3) % 47 + 1 for i in range(20)]
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)  # caches two pages of 8
    for given in (prompt, words(prompt), [words(prompt)] * 2, [prompt] * 2):
        got = client.completions.create(model="tiny", prompt=given, max_tokens=1, logprobs=1, echo=True,
                                        temperature=0, extra_body={"ignore_eos": True})
        for choice in got.choices:
            assert choice.text.startswith(words(prompt))
            check_completion_logprobs(choice.logprobs, model, prompt, reference(model, prompt, 1), 1, echo=True)
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True, temperature=0)
    assert echoed.choices[0].text.startswith(words(prompt)) and echoed.choices[0].logprobs is None


def test_penalties_and_logit_bias_equal_a_greedy_reference(oracle_server, random_world):
    client, (_, model) = oracle_server.client(), random_world
    tokenizer = PreTrainedTokenizerFast.from_pretrained(random_world[0] / "target")
    prompt = [3, 17, 5, 9, 30, 2]
    for settings in SETTINGS:
        body = dict(frequency_penalty=settings.get("frequency"), presence_penalty=settings.get("presence"),
                    logit_bias={str(t): b for t, b in settings["bias"].items()} if "bias" in settings else None)
        extra = {"ignore_eos": True} | ({"repetition_penalty": settings["repetition"]} if "repetition" in settings
                                        else {})
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=14, temperature=0,
                                        extra_body=extra, **{k: v for k, v in body.items() if v is not None})
        want = reference(model, prompt, 14, **settings)
        assert got.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), settings


@pytest.fixture(scope="module")
def tree_server(random_world):
    """The oracle server's world and pages through a draft tree (6 nodes, 3 steps of 2 beams)."""
    s = Server(random_world[0], "--max-batch", "4", "--page-size", "8", "--num-draft-tokens", "6", "--draft-depth", "3",
               "--draft-top-k", "2")
    yield s
    s.stop()


@pytest.mark.parametrize("drafts", ["chain", "tree"])
def test_speculative_equals_spec_off_with_every_field_set(request, random_world, drafts):
    """Prompt lists, n, penalties, logit_bias, logprobs and echo together through the speculative server (gamma 2, or
    a draft tree) equal spec-off Engine.generate with the same settings: the tokens, and the logprobs within
    TOLERANCE."""
    oracle_server = request.getfixturevalue("oracle_server" if drafts == "chain" else "tree_server")
    folder, _ = random_world
    target = eagle3_jax.load_target(folder / "target", dtype="float32", progress=False)
    prompts = [[3, 17, 5, 9], [40, 2, 11]]
    settings = dict(frequency_penalty=0.6, presence_penalty=0.3, repetition_penalty=1.4, logit_bias={9: 2.5, 4: -3.0})
    results = eagle3_jax.Engine(target, max_len=MAX_LEN).generate(
        prompts, 12, [EOS], **settings, logprobs=2, prompt_logprobs=2)
    got = oracle_server.client().completions.create(
        model="tiny", prompt=prompts, max_tokens=12, temperature=0, n=2, echo=True, logprobs=2,
        frequency_penalty=0.6, presence_penalty=0.3, logit_bias={"9": 2.5, "4": -3.0},
        extra_body={"repetition_penalty": 1.4})
    for i, result in enumerate(results):
        for choice in got.choices[2 * i : 2 * i + 2]:
            logprobs = choice.logprobs
            assert logprobs.tokens == [f"w{t}" for t in prompts[i] + result.token_ids]
            want = [None] + [e.logprob for e in result.prompt_logprobs[1:]] + [e.logprob for e in result.logprobs]
            assert logprobs.token_logprobs[0] is None
            assert np.allclose(logprobs.token_logprobs[1:], want[1:], atol=TOLERANCE)


LOGPROB_BAD = [  # (endpoint, body, the field named)
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("completions", {"presence_penalty": -3}, "presence_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"logit_bias": {"w3": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"3": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"48": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # "²": a digit to str.isdigit, not to int()
    ("completions", {"repetition_penalty": float("inf")}, "repetition_penalty"),  # JSON's Infinity: the pool's check
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("chat", {"max_completion_tokens": 5}, "max_completion_tokens"),  # beside the request's max_tokens 4
]


@pytest.mark.parametrize("endpoint, body, field", LOGPROB_BAD)
def test_bad_logprobs_and_penalties_are_refused_naming_the_field(server, endpoint, body, field):
    request = {"model": "tiny", "max_tokens": 4, **body}
    request |= {"prompt": [1, 2]} if endpoint == "completions" else {"messages": [{"role": "user", "content": "w5"}]}
    response = httpx.post(f"{server.url}/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                          content=json.dumps(request), headers={"content-type": "application/json"})  # Infinity too
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.json()


GENERATE_TASK = """task: e3_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["{stop}"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""
CHOICE_TASK = """task: e3_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""


@pytest.mark.lm_eval
@pytest.mark.parametrize("tokenized", [True, False])
def test_lm_evaluation_harness_against_the_server(oracle_server, random_world, tmp_path, tokenized, monkeypatch):
    """lm-evaluation-harness 0.4.13's `local-completions` against the served random world, token ids or text: a
    generate_until task (its answers the oracle's greedy continuations, cut at the stop string) and a multiple-choice
    one (each choice's loglikelihood the oracle's: lm-eval reads the echoed prompt's logprobs after the context, and
    whether the continuation is greedy), both defined here with no download."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    folder, model = random_world
    rng = np.random.default_rng(7)
    contexts = [rng.integers(1, 47, size=int(n)).tolist() for n in (5, 9, 3)]
    stop = "w9"
    generate = [{"context": words(c), "target": words(reference(model, c, 2))} for c in contexts]
    choices = [{"context": words(c), "choices": [words(rng.integers(1, 47, size=k).tolist()) for k in (1, 2, 3)],
                "label": 1} for c in contexts]
    greedy = reference(model, contexts[0], 2)
    choices[0]["choices"][0] = words(greedy[:1])  # a greedy continuation: is_greedy must say so
    for name, rows, task in (("generate", generate, GENERATE_TASK), ("choice", choices, CHOICE_TASK)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / f"{name}.yaml").write_text(task.format(data=data, stop=stop))
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["e3_generate", "e3_choice"], task_manager=TaskManager(
            include_path=str(tmp_path)), log_samples=True, bootstrap_iters=0,
        model_args={"base_url": oracle_server.url + "/v1/completions", "model": "tiny",
                    "tokenizer": str(folder / "target"), "tokenizer_backend": "huggingface",
                    "tokenized_requests": tokenized, "max_length": MAX_LEN})
    assert [len(results["samples"][task]) for task in ("e3_generate", "e3_choice")] == [3, 3]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "target")
    for sample in results["samples"]["e3_generate"]:
        tokens = reference(model, [int(w[1:]) for w in sample["doc"]["context"].split()], 8)
        tokens = tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens
        assert sample["resps"][0][0] == tokenizer.decode(tokens, skip_special_tokens=True).split(stop)[0]
    for sample in results["samples"]["e3_choice"]:
        context = [int(w[1:]) for w in sample["doc"]["context"].split()]
        for choice, (loglikelihood, is_greedy) in zip(sample["doc"]["choices"], (r[0] for r in sample["resps"])):
            continuation = [int(w[1:]) for w in choice.split()]
            lp = oracle_logprobs(model, context + continuation)
            rows = lp[len(context) - 1 : -1]
            assert abs(loglikelihood - sum(r[t] for r, t in zip(rows, continuation))) < TOLERANCE
            assert is_greedy == all(int(np.argmax(r)) == t for r, t in zip(rows, continuation))
    greedy_flags = [r[0][1] for r in results["samples"]["e3_choice"][0]["resps"]]
    assert greedy_flags[0]  # the planted greedy continuation (the check can fail)


def test_a_fault_of_the_servers_own_gets_an_openai_error_body_and_the_server_keeps_serving():
    """An exception the handlers do not expect (here the tokenizer's) is a 500 with OpenAI's error body, not
    Starlette's plain text, and the app answers the next request."""
    import types

    from fastapi.testclient import TestClient

    from eagle3_jax.serving.app import ServerState, build_app

    class BrokenTokenizer:
        chat_template = None

        def __call__(self, text, **kwargs):
            raise RuntimeError("the tokenizer broke")

    pool = types.SimpleNamespace(error=None, engine=types.SimpleNamespace(max_len=64))
    state = ServerState(pool, BrokenTokenizer(), "tiny", dict(OPENAI_DEFAULTS), (0,), metrics=object())
    client = TestClient(build_app(state), raise_server_exceptions=False)
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2})
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "server_error" and "the tokenizer broke" in error["message"] and error["code"] == 500
    assert client.get("/health").status_code == 200
