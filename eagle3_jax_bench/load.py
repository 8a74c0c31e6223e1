"""A load generator for an OpenAI-compatible server: `users` clients, each a closed loop that streams one
completion at a time and waits an exponential think time (mean think_s) before the next, so that each user's
requests arrive as a Poisson process while it is idle. It runs in a process of its own (the server's process is
then measured without the client's work) and imports no JAX."""

from __future__ import annotations

import asyncio
import json
import random
import time


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int, logprobs: int | None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if logprobs is not None:
        body["logprobs"] = logprobs
    sent = time.perf_counter()
    chunks, text, usage, reason, scored = [], [], None, None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            payload = json.loads(line[6:])
            if payload.get("usage"):
                usage = payload["usage"]
            for choice in payload.get("choices", []):
                if choice["text"]:
                    chunks.append(time.perf_counter())
                    text.append(choice["text"])
                if choice.get("logprobs"):
                    scored += len(choice["logprobs"]["token_logprobs"])
                reason = choice["finish_reason"] or reason
    return {"sent": sent, "chunks": chunks, "text": "".join(text), "usage": usage, "finish_reason": reason,
            "logprobs": scored}


async def _run(url: str, model: str, requests: list[tuple[list[int], int]], users: int, think_s: float,
               seed: int, logprobs: int | None) -> list[dict]:
    import httpx

    queue = list(enumerate(requests))
    results: list[dict | None] = [None] * len(requests)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def user():
            while queue:
                i, (prompt, max_tokens) = queue.pop(0)
                results[i] = await _one(client, url, model, prompt, max_tokens, logprobs)
                if think_s > 0:
                    await asyncio.sleep(rng.expovariate(1 / think_s))

        await asyncio.gather(*(user() for _ in range(users)))
    return results


def run_load(url: str, model: str, requests: list[tuple[list[int], int]], users: int, think_s: float,
             seed: int = 0, logprobs: int | None = None) -> list[dict]:
    """Every request's send time, chunk arrival times, text, usage, finish reason and the tokens whose logprobs came
    back (with `logprobs`: each request asks for them, that many alternatives a token), in request order."""
    return asyncio.run(_run(url, model, requests, users, think_s, seed, logprobs))
