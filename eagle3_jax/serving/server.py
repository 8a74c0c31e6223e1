"""`eagle3-jax serve`: loads the target (and drafter), builds the engine and its live pool, warms it up, and
serves the app (app.py) with uvicorn until a signal.

SIGTERM drains: new requests get 503 while the running ones have up to --drain-s seconds to finish; those
left are then aborted and the server exits 0. SIGINT does the same without waiting (a second one exits at
once).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import uvicorn

from eagle3_jax.checkpoints.generation import generation_sampling
from eagle3_jax.checkpoints.tokenizer import eos_stop_ids, load_tokenizer
from eagle3_jax.serving.app import ServerState, build_app
from eagle3_jax.serving.metrics import Metrics

# A request that gives no sampling settings and finds none in generation_config.json samples at temperature 1,
# as OpenAI's API does.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


def request_defaults(target_folder) -> dict:
    """The sampling settings a request leaves out: the target's generation_config.json, else OPENAI_DEFAULTS."""
    return generation_sampling(target_folder) or dict(OPENAI_DEFAULTS)


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM or SIGINT drains the live pool before it stops (the module
    docstring); the signal is not raised again after the server stops, so the process exits 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_s: float):
        super().__init__(config)
        self.state, self.drain_s = state, drain_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.state.draining or self._loop is None:
            self.force_exit = self.should_exit = True
            return
        self.state.draining = True
        wait = self.drain_s if sig == signal.SIGTERM else 0.0
        self._loop.call_soon_threadsafe(self._start_drain, wait)

    def _start_drain(self, wait: float) -> None:
        self._drain_task = self._loop.create_task(self._drain(wait))  # held: the loop keeps only a weak reference

    async def _drain(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        while self.state.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self.state.live):
            self.state.pool.abort(request_id)
        deadline = time.monotonic() + 5.0  # the aborted requests' handlers answer, then the server stops
        while self.state.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


def warm_up(engine, defaults: dict) -> int:
    """Every program the server's pool can run compiled before the first client: the greedy build's, and the
    sampling build its default settings take (generation_config.json's); a request of other filters compiles
    its build on first use. With the persistent cache warm, nothing (Engine.compile). Returns the programs
    compiled."""
    programs = engine.compile()
    if defaults.get("temperature", 0) > 0:
        programs += engine.compile(samples=True, top_k=int(defaults.get("top_k", 0)))
    return programs


def serve(args) -> int:
    import eagle3_jax
    from eagle3_jax.decoding import warm_start
    from eagle3_jax.decoding.live import LivePool

    tokenizer = load_tokenizer(args.target)
    if tokenizer is None:
        raise ValueError(f"{args.target} has no tokenizer: the server needs one for text and chat")
    dtype, mesh = args.dtype, args.mesh
    target = eagle3_jax.load_target(args.target, dtype=dtype, mesh=mesh)
    proposer = args.proposer  # cli.proposer_from_args: a PromptLookup, a drafter folder, or None
    drafter = eagle3_jax.load_drafter(proposer, target, dtype=dtype) if isinstance(proposer, str) else proposer
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=args.num_draft_tokens, max_len=args.max_len,
                               max_batch=args.max_batch, max_draft_tokens=args.max_draft_tokens, mesh=mesh,
                               kv_tokens=args.kv_tokens, page_size=args.page_size, prefill_chunk=args.prefill_chunk,
                               rounds_per_call=args.rounds_per_call, draft_depth=args.draft_depth,
                               draft_top_k=args.draft_top_k)
    compilations = warm_start.Compilations()  # /metrics reports them: none after a warm start
    defaults = request_defaults(args.target)
    programs = warm_up(engine, defaults)
    print(f"compiled {programs} programs ahead", file=sys.stderr, flush=True)
    pool = LivePool(engine)
    try:
        name = args.served_model_name or Path(args.target).resolve().name
        state = ServerState(pool, tokenizer, name, defaults, eos_stop_ids(tokenizer), api_key=args.api_key,
                            metrics=Metrics(pool, compilations))
        # log_config None: uvicorn's own dictConfig would shut down every logging handler in the process (absl's
        # closes its stream then); its loggers still take log_level.
        config = uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level="warning",
                                log_config=None, lifespan="off")
        print(f"serving {name} on http://{args.host}:{args.port} (max_len {engine.max_len}, {engine.max_batch} slots)",
              file=sys.stderr, flush=True)
        DrainingServer(config, state, args.drain_s).run()
    finally:
        pool.close()
        compilations.close()
    return 0
