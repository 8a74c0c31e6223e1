"""`eagle3-jax serve` run as a user runs it, on 127.0.0.1, driven by the official `openai` client: every answer
equals offline `Engine.generate` decoded, with its usage and acceptance; bad requests get OpenAI-style errors
and the server keeps serving; an abandoned stream is aborted; signals drain; a bounded load loses nothing.

The checkpoint is the permutation world (tests/spec_worlds.py) with the pi2 drafter, whose first draft of every
round is accepted and second never: acceptance is known exactly. Its tokenizer is a word-level one (token i is
the word "wi", w47 the end of sequence) with a small chat template."""

import concurrent.futures
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

MAX_LEN, GAMMA, EOS = 64, 2, 47
ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %} w4{% endif %}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    _, target = worlds.save_target("permutation", root / "target", layers=4)
    worlds.save_drafter("pi2", root / "drafter", target)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(worlds.V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{EOS}", unk_token="w0")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(root / "target")
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
    ({"n": 2}, 400, "n"),
    ({"stop_token_ids": list(range(9))}, 400, "at most 8 stop token ids"),
    ({"model": "other"}, 404, "the model `other` does not exist"),
]


@pytest.mark.parametrize("body, status, message", BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, message):
    request = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, **body}
    response = httpx.post(server.url + "/v1/completions", json=request)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == status
    assert server.client().completions.create(model="tiny", prompt=[1], max_tokens=2).usage.completion_tokens >= 1


def test_malformed_json_and_the_clients_errors(server):
    response = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().completions.create(model="tiny", prompt=[1], temperature=7)
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "w1"}])
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
