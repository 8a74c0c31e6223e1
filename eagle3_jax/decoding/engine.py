"""The host side: a checked request (request.py) decoded through a pool of slots (live.py, live_plan.py,
slots.py) over the engine's paged KV (page_pool.py): prompts are prefilled into free slots and their pages in
input order and one jitted call of rounds after another runs over the pool, so any number of prompts runs in
the pool's memory; a sequence holds pages for the tokens it has, and when they run out the youngest is
preempted and later recomputed (`Engine.preemptions` counts them). `generate`, `stream` and
`as_completed` run a live pool of their own, the one the server runs (decoding/live.py), given every prompt at
once.

Each device operation's outputs come back in one small device-to-host transfer (prefill's first tokens,
or a call's rounds). Stop checks run on the device; rounds run after every row is done change nothing and
are dropped. `Engine.device_events` records what the latest request did.

The jitted steps are module-level: their static configuration (`StepSpec`) is a hashable argument, so
every Engine of the same configuration, and every request of the same shapes, reuses one compilation.

Sampling settings (temperature, top-k, top-p, seed) travel as device arrays, one value per row, so new
values never recompile. An Engine has three builds of its steps: the greedy one, which a request whose rows
are all greedy runs (no sampling work at all), and two sampling ones, which run any request with a sampled
row and handle greedy rows beside them: the candidate filter's when every sampled row's top_k is in [1, 64],
else the radix search's (sampling.filter_for). Each has variants with penalties and logit_bias (penalties.py) and
with logprobs (logprobs.py), which only a request that has them runs. Each compiles once, when first needed.

num_draft_tokens="auto" builds one step per gamma 0 .. max_draft_tokens (StepSpec.gamma; the DecodeState
is the same pytree for all, so the pool's donated state flows from one to another and a change of gamma
never recompiles), and each call of rounds runs the gamma gamma_policy.py picks from the acceptance seen so
far in the request and round_costs.py's measured cost of each gamma at the pool's batch size and KV length.

With a tensor-parallel mesh (`Engine(mesh=...)`) the same steps run as shard_maps over it (decoding/parallel_steps.py);
a sampling build there always runs the radix search (the candidate filter is per device), and
num_draft_tokens="auto" is refused (its round costs and held pairs are one device's).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import os
import queue
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from eagle3_jax.checkpoints.target import Target
from eagle3_jax.decoding import (
    engine_args,
    gamma_policy,
    live,
    live_plan,
    page_pool,
    parallel_steps,
    round_costs,
    spec_round,
    warm_start,
)
from eagle3_jax.decoding import logprobs as logprobs_lib
from eagle3_jax.decoding import progress as progress_lib
from eagle3_jax.decoding import proposer as proposer_lib
from eagle3_jax.decoding import sampling as sampling_lib
from eagle3_jax.decoding.engine_args import DEFAULT_PROPOSAL, PROPOSALS
from eagle3_jax.decoding.request import Request
from eagle3_jax.decoding.structured import Compiler, Structured, target_vocabulary
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models import kv_cache

ROUNDS_PER_CALL = 4  # the default: 4 save most of a call's overhead (k = 8: 0.6% more; BENCHMARKS.md)
# Engine(exact=...)'s default. The exact kernels cost speed (BENCHMARKS.md): they become the default
# where they cost at most 3% of a decode step at batch 1 and 8 on the H200.
DEFAULT_EXACT = False
# Engine(max_batch=None)'s slots on a GPU; a larger batch compiles and runs steps no user of one GPU is likely to
# want. A slot holds no KV of its own (its sequence's pages do), so slots are cheap.
MAX_DEFAULT_BATCH = 256
CPU_DEFAULT_BATCH = 8  # ... and on the CPU, whose decoding is for tests and demos
# Engine(prefill_chunk=...)'s default: the most prompt tokens one target forward (each round of a call) carries.
# Provisional until the GPU sweep (BENCHMARKS.md (m)) sets it.
PREFILL_CHUNK = 512
# ... and on the CPU, where a forward's arrays are as wide whatever it holds: 128 a round is 512 a call of 4 rounds
CPU_PREFILL_CHUNK = 128
# Engine(prefill_sequences=None): prompts one chunk holds, one for each PROMPT_TOKENS_PER_SEQUENCE of its tokens
# (2 to 16). A chunk's arrays and its attention kernel's grid are that wide whatever it holds, so a few prompts of
# typical length fill it, where one per token would launch mostly empty work.
PROMPT_TOKENS_PER_SEQUENCE = 128


@dataclasses.dataclass(frozen=True)
class RoundTrace:
    """One speculative round of one sequence, for inspection (`generate(..., trace=True)`). A draft tree's round
    (draft_top_k > 1) also has `parents` and `path`: the tree is node 0, the root (the newest token, already
    emitted), and nodes 1 .. N, node i's token drafted[i - 1] and its parent node parents[i - 1] (0: the root; a
    parent comes before its children), and the accepted path is the nodes path[0 .. accepted - 1], one a level."""

    # The proposer's gamma proposals, as target ids (-1: a position prompt lookup left empty); a tree's N nodes.
    drafted: list[int]
    # After each of [x_n, d_1 .. d_gamma]: a greedy row's argmax; a sampled row's accepted drafts, then the
    # token sampled after them, then the target's argmax. A tree's: along its accepted path (gamma its depth): the
    # accepted nodes' tokens, then the bonus token after them (the argmax there, or sampled), then padding.
    target: list[int]
    # How many drafts the round committed: those accepted before the first rejection, fewer when the round
    # was cut short (by a stop token, max_new_tokens or max_len) before emitting them all.
    accepted: int
    parents: list[int] | None = None  # a tree's: each node's parent node
    path: list[int] | None = None  # a tree's: the nodes of its accepted path, by depth


@dataclasses.dataclass(frozen=True)
class Result:
    token_ids: list[int]  # generated tokens only
    finish_reason: str  # "stop" (ended at a stop token, included) or "length"
    # Per speculative round: the drafts it committed (0..gamma; RoundTrace.accepted); empty when spec is off.
    # tau = mean(a + 1): tokens per target step. Under "auto" a gamma-0 round counts as a round that
    # accepted 0 (it emits one token), so tau stays tokens per target step over every round.
    accept_lengths: list[int]
    rounds: list[RoundTrace] | None = None  # per-round detail, with trace=True
    # The gamma each round of accept_lengths ran (all the engine's gamma unless num_draft_tokens="auto").
    gammas: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0  # the prompt tokens served from the prefix cache (Engine(prefix_caching=...))
    # With generate(logprobs=k): each generated token's log-probability under the target (its raw log-softmax, before
    # temperature, penalties and filters) and its position's k most likely (id, logprob) pairs.
    logprobs: list[logprobs_lib.TokenLogprobs] | None = None
    # With generate(prompt_logprobs=k): the same for each prompt token (None for the first, which nothing predicts).
    prompt_logprobs: list[logprobs_lib.TokenLogprobs | None] | None = None


def round_trace(trace: tuple, accepted: int) -> RoundTrace:
    """An event's trace (live_plan.Event.trace: (drafts, target choices), and a tree round's parents and path) as the
    RoundTrace of a round that committed `accepted` drafts."""
    drafted, target, *tree = trace
    if not tree:
        return RoundTrace(drafted, target, accepted)
    parents, path = tree
    return RoundTrace(drafted, target, accepted, parents, path[:accepted])


# Shared by every Engine; jax.jit caches one executable per (StepSpec, argument shapes and dtypes).
jit_empty = jax.jit(spec_round.new_rows, static_argnums=(0, 1, 2, 3, 4))
jit_prefill = jax.jit(spec_round.prefill, static_argnames=("spec",), donate_argnames=("state",))
jit_rounds = jax.jit(spec_round.spec_rounds, static_argnames=("spec", "num_rounds"), donate_argnames=("state",))
jit_new_pages = jax.jit(spec_round.new_pages, static_argnums=(0, 1, 2, 3))
ONE_DEVICE = parallel_steps.Steps(jit_empty, jit_prefill, jit_rounds, put=jax.device_put,
                                  fetch=jax.device_get, new_pages=jit_new_pages)


class Engine:
    """Decoding of a Qwen3 target, greedy or sampled per row, speculative when a proposer is given (`drafter`: an
    EAGLE-3 Drafter, or PromptLookup; decoding/proposer.py). Lossless: a greedy row's output is token for token
    what plain greedy decoding of the target gives, and a sampled row's output is distributed exactly as sampling
    the target alone.

    Its live pools (live.py) execute the scheduler's steps through `steps` (the jitted step functions, one
    device's or a mesh's), `build_for` and `prefill_build` (the static build a step's rows need;
    `greedy_template` names the greedy one), the target's params and `draft_params`: the engine holds the
    configuration and the pages, the pool runs them."""

    def __init__(self, target: Target, drafter=None, num_draft_tokens: int | str = 3, max_len: int | None = None,
                 kernels: str | None = None, rounds_per_call: int = ROUNDS_PER_CALL,
                 proposal: str = DEFAULT_PROPOSAL, exact: bool = DEFAULT_EXACT, max_batch: int | None = None,
                 prefill_chunk: int | None = None, max_draft_tokens: int | None = None, round_costs=None,
                 mesh=None, kv_tokens: int | None = None, page_size: int | None = None,
                 prefill_sequences: int | None = None, prefix_caching: bool = True, constrain_drafts: bool = True,
                 draft_depth: int | None = None, draft_top_k: int = 1):
        """drafter: what proposes the drafts: an EAGLE-3 `Drafter` (load_drafter), `PromptLookup()` (n-gram lookup
        in the row's own tokens, no weights), or None (spec off); anything else is refused.
        num_draft_tokens: the drafts per round (gamma), or "auto": each call of rounds takes the gamma in
        0 .. max_draft_tokens (None: engine_args.DEFAULT_MAX_DRAFT_TOKENS) of the most expected tokens per second
        (gamma_policy.py), gamma 0 being a plain step; needs a drafter, and one device (refused with a mesh).
        round_costs: under "auto", `round_costs(batch, kv_length)` -> seconds of a call of each gamma 0 ..
        max_draft_tokens; None measures them on this device on first use of a batch size and caches them on
        disk (round_costs.py).
        max_len: the KV capacity of a row, prompt and output (None: engine_args.DEFAULT_MAX_LEN, 4096, or the
        target's max_position_embeddings where smaller).
        rounds_per_call: rounds run by one device call (a lax.scan) and returned in one transfer. More
        save the per-call overhead (about 0.2-0.3 ms on the H200) more often; fewer deliver tokens sooner
        (a call's rounds arrive together) and run fewer rounds in vain after a stop token.
        draft_top_k, draft_depth: draft_top_k 1 (the default) drafts a chain of num_draft_tokens (draft_depth None,
        or num_draft_tokens). draft_top_k K > 1 drafts a tree (EAGLE-2/3's, decoding/tree.py) with an EAGLE-3
        drafter: draft_depth D drafting steps of K beams, of whose K + (D - 1) K^2 scored candidates the N =
        num_draft_tokens of highest path probability are verified in one target forward (N + 1 tokens with the
        root), and each round accepts the longest root path the target agrees with (greedy), or one by the
        multi-draft rule (sampled: lossless). accept_lengths and gammas then count depths (0 .. D). Refused with
        "auto", proposal="sample", exact=True, a mesh and PromptLookup (engine_args.check_tree says why).
        proposal: how the drafter proposes for a sampled row: "argmax" (q one-hot, accepted with
        probability p(x)) or "sample" (x drawn from the drafter's filtered q, accepted with probability
        min(1, p(x) / q(x))). Both are lossless; which accepts more is the drafter's to show. Greedy rows
        ignore it, and so does PromptLookup, whose proposals are tokens (q one-hot): "sample" runs as "argmax".
        exact: the target's decode and verify steps run kernels whose result for a token does not depend
        on how many tokens or rows share the step (eagle3_jax/models/kernels.py, EXACT), so greedy
        speculative output is bit for bit spec-off output in 16-bit too, not only in float32. Prefill and
        the drafter run `kernels`. Off the GPU the exact kernels run in Pallas' interpreter (slow).
        max_batch: the slots of the pool every request decodes through; each call computes only the bucket of rows
        it runs (live_plan.row_bucket: a power of two). None: MAX_DEFAULT_BATCH on a GPU, CPU_DEFAULT_BATCH on the
        CPU.
        kv_tokens: the tokens of KV the engine's page pools hold, the target's and the drafter's (rounded up to
        whole pages, and at least one whole sequence of max_len); what every running sequence shares. None: on a
        GPU, page_pool.KV_SHARE of the device's memory limit after the weights; on the CPU, max_batch x max_len.
        KV that does not fit in the device's free memory is refused here, before anything is allocated.
        page_size: tokens per page (None: page_pool.default_page_size: DEFAULT_PAGE_SIZE, less for a max_len below
        it).
        prefill_chunk: (None: PREFILL_CHUNK on a GPU, CPU_PREFILL_CHUNK on the CPU) the most prompt tokens one
        target forward carries: every round of a call carries up to that many in its target forward (a mixed call:
        the chunk rides on the weights the rounds read anyway), packed from one or more prompts; a longer prompt
        goes on in the next round's chunk, of the same call or the next. A prompt whose last chunk runs in round r
        joins the pool's rows at once and runs rounds r + 1 onwards of that call. With exact=True (its kernels'
        results must not depend on rows beside them) a chunk is a call of its own instead.
        prefill_sequences: the most prompts one chunk holds (None: one per PROMPT_TOKENS_PER_SEQUENCE of
        prefill_chunk, 2 to 16, at most max_batch).
        prefix_caching: full pages of committed KV (the target's and the drafter's) are kept, keyed by a sha256
        chain of the tokens they hold and all before them, and a later prompt with the same prefix starts after
        them (`Result.cached_tokens`); the cache outlives a request (the same engine's next one reuses it) and gives
        its pages up least-recently-used when sequences need them (decoding/page_pool.py).
        mesh: a tensor-parallel mesh (parallel/mesh.py's tp_mesh; docs/tensor-parallel.md); None: the target's
        (load_target(mesh=...)), else one device. A target and drafter not yet on it are placed there (the
        caller's unsharded copies stay where they are); a tp that does not split the target is refused, naming
        the sizes.
        constrain_drafts: a constrained row's drafts follow its constraint too (masked proposals: the drafter's
        chain moves the row's automaton along its own drafts, prompt lookup's proposal is cut where it leaves it);
        False drafts unconstrained, for measuring what that gains (lossless either way: docs/structured.md)."""
        cfg = target.config
        proposer, dparams = proposer_lib.resolve(drafter)
        mesh = target.mesh if mesh is None else mesh
        gamma, self.auto = engine_args.check_gamma(proposer is not None, num_draft_tokens, max_draft_tokens,
                                                   on_mesh=mesh is not None)
        max_len = engine_args.check_sizes(cfg, proposer is not None, gamma, max_len, rounds_per_call)
        engine_args.check_max_batch(max_batch)
        engine_args.check_pages(kv_tokens, page_size, max_len)
        engine_args.check_prefill(prefill_chunk, prefill_sequences, prefix_caching)
        self.prefix_caching = prefix_caching
        kernels = kernels_lib.check(kernels or kernels_lib.default())
        engine_args.check_proposal(proposal)
        tree = engine_args.check_tree(hasattr(proposer, "propose_tree"), num_draft_tokens, draft_depth, draft_top_k,
                                      auto=self.auto, proposal=proposal, exact=exact, on_mesh=mesh is not None)
        engine_args.check_exact(cfg, exact)
        if tree is not None and tree.top_k > proposer.config.draft_vocab_size:
            raise ValueError(f"draft_top_k={tree.top_k} is more than the drafter's {proposer.config.draft_vocab_size} "
                             f"draft tokens")
        self.tree = tree  # the draft tree's shape (decoding/tree.TreeShape), None for a chain
        self.steps = ONE_DEVICE  # the jitted step functions (parallel_steps.Steps); a mesh's below
        if mesh is not None:  # the arguments are checked first: placing the models is device work
            weighted = drafter if dparams is not None else None  # a proposer with weights is placed on the mesh
            target, weighted, self.steps = parallel_steps.on_mesh(target, weighted, mesh, exact)
            if weighted is not None:
                drafter, dparams = weighted, weighted.params
        self.target, self.drafter, self.max_len = target, drafter, max_len
        self._proposer, self._dparams = proposer, dparams
        default_batch = CPU_DEFAULT_BATCH if jax.default_backend() == "cpu" else MAX_DEFAULT_BATCH
        self.max_batch = default_batch if max_batch is None else int(max_batch)
        self._rounds_per_call = int(rounds_per_call)
        if prefill_chunk is None:
            prefill_chunk = CPU_PREFILL_CHUNK if jax.default_backend() == "cpu" else PREFILL_CHUNK
        self.prefill_chunk = int(prefill_chunk)
        default = min(16, max(2, self.prefill_chunk // PROMPT_TOKENS_PER_SEQUENCE))
        self.prefill_sequences = min(self.max_batch, int(prefill_sequences or default), self.prefill_chunk)
        # Under "auto", the largest gamma; a tree's nodes.
        self.num_draft_tokens = gamma if proposer is not None else 0
        # The gamma its rounds run (the drafts a round may commit): a chain's gamma, a tree's depth; under "auto" the
        # largest gamma. Prefill packs its output at this width.
        self.draft_depth = tree.depth if tree is not None else self.num_draft_tokens
        self._given_costs, self._costs = round_costs, {}
        self._spec = spec_round.StepSpec(
            target=cfg,
            proposer=proposer,
            gamma=self.draft_depth,
            max_len=self.max_len,
            kernels=kernels,
            exact=exact,
            held=gamma_policy.FLUSH_CALLS * self._rounds_per_call if self.auto and self._holds else 0,
            constrain_drafts=bool(constrain_drafts),
            tree=tree,
        )
        self._compiler = None  # structured outputs' compiler, made on the first constraint (Engine.constraint)
        if mesh is not None:
            self._spec = parallel_steps.local_spec(self._spec, target.mesh.devices.size)
        self.page_pool = self._page_pool(kv_tokens, page_size or page_pool.default_page_size(max_len))
        self.preemptions = 0  # sequences preempted (their pages freed, recomputed later) since construction
        self.cached_tokens = 0  # prompt tokens served from the prefix cache since construction (Result.cached_tokens)
        # Without a proposer that samples its drafts (none, or prompt lookup, whose drafts are tokens) "sample" is
        # "argmax": one sampling build for either choice.
        samples = proposer is not None and proposer.samples_drafts
        self._sampling_spec = dataclasses.replace(self._spec, sampling=True,
                                                  proposal=proposal if samples else DEFAULT_PROPOSAL)
        # Prefill draws no drafts: one compilation of it serves both proposals.
        self._sampling_prefill_spec = dataclasses.replace(self._sampling_spec, proposal=PROPOSALS[0])
        self.device_events: list[tuple[str, tuple[int, ...]]] = []

    def _page_pool(self, kv_tokens: int | None, page_size: int) -> page_pool.PagePool:
        """The engine's pages: enough for kv_tokens (and one sequence of max_len at least); refused when they do
        not fit in the device's free memory."""
        spec, proposer = self._spec, self._proposer
        cfg, dtype = spec.target, self.target.params["embed"].dtype  # the per-device config on a mesh
        token_bytes = kv_cache.token_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype.itemsize)
        if proposer is not None:
            token_bytes += proposer.token_elements() * dtype.itemsize
        given = ""
        if kv_tokens is None:
            devices = 1 if self.target.mesh is None else self.target.mesh.devices.size
            weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((self.target.params, self._dparams)))
            weights //= devices
            kv_tokens = page_pool.default_kv_tokens(weights, token_bytes, page_size, self.max_batch, self.max_len)
            given = (" (max_batch x max_len, the CPU's default)" if page_pool.device_memory_limit() is None else
                     f" (the default: {page_pool.KV_SHARE:.0%} of the device's memory after the weights)")
        num_pages = max(page_pool.pages_for(kv_tokens, page_size), page_pool.pages_for(self.max_len, page_size))
        need, free = num_pages * page_size * token_bytes, page_pool.free_device_bytes()
        if need > free:  # an engine dropped inside some reference cycle frees its pages only when collected
            gc.collect()
            free = page_pool.free_device_bytes()
        if need > free:
            raise ValueError(f"kv_tokens={kv_tokens}{given} ({need / 2**30:.2f} GiB of KV in pages of {page_size}) "
                             f"does not fit in the device's free memory ({free / 2**30:.2f} GiB): lower kv_tokens")
        self.table_width = kv_cache.table_width(self.max_len, page_size, max(self.draft_depth + 1, spec.held + 1,
                                                                             self.scratch + self.draft_depth + 1))
        self.kv_tokens = num_pages * page_size
        # The engine's device page pools, zeroed when first used: the target's and its proposer's (or None); on a
        # mesh each device holds its KV heads (the spec's per-device config). A partial, not a bound method: the pool
        # must not hold the engine, or a dropped engine's pages would wait for the garbage collector.
        new_pages = functools.partial(self.steps.new_pages, spec, num_pages, page_size, dtype)
        return page_pool.PagePool(num_pages, page_size, new_pages)

    @property
    def page_size(self) -> int:
        return self.page_pool.page_size

    def build_for(self, request: Request) -> spec_round.StepSpec:
        """The build a request runs: the sampling one when some row samples, with the filter its settings
        need (sampling.filter_for; on a mesh, the radix search); with penalties when some row has any, with
        logprobs when some row asks for them."""
        spec = self._spec
        if request.samples:
            # A vocabulary split over a mesh takes the radix search: the candidate filter's top-k is per device.
            chosen = "radix" if self._spec.tp is not None else sampling_lib.filter_for(request.sampling)
            spec = dataclasses.replace(self._sampling_spec, filter=chosen)
        return dataclasses.replace(spec, penalties=request.penalized, logprobs=request.wants_logprobs)

    def prefill_build(self, spec: spec_round.StepSpec, prompt_logprobs: bool = False) -> spec_round.StepSpec:
        """The prefill of a build: one for both proposals (prefill draws no drafts), with the build's filter,
        penalties and logprobs; prompt_logprobs: it also reports each chunk position's (logprobs.py)."""
        base = dataclasses.replace(self._sampling_prefill_spec, filter=spec.filter) if spec.sampling else self._spec
        return dataclasses.replace(base, penalties=spec.penalties, logprobs=spec.logprobs or prompt_logprobs,
                                   prompt_logprobs=prompt_logprobs)

    def check_outputs(self, request: Request) -> None:
        """Refuses (ValueError) what this engine cannot honour: penalties, logit_bias and logprobs on a tensor-parallel
        mesh (their reductions over the vocabulary are one device's)."""
        if self._spec.tp is None:
            return
        for name, asked in (("penalties and logit_bias", request.penalized), ("logprobs", request.wants_logprobs)):
            if asked:
                raise ValueError(f"{name} are not built for a tensor-parallel mesh: run the engine on one device")

    @property
    def spec(self) -> spec_round.StepSpec:
        """The static configuration the jitted steps (`jit_rounds`, `jit_prefill`) are compiled for when
        every row is greedy (requests with a sampled row run it with `sampling=True`)."""
        return self._spec

    @property
    def rounds_per_call(self) -> int:
        """Rounds per device call, fixed at construction: the jitted scan is built for it."""
        return self._rounds_per_call

    @property
    def draft_params(self):
        """The proposer's weights (None: spec off, or a proposer without weights)."""
        return self._dparams

    @property
    def _holds(self) -> bool:
        """Whether "auto"'s plain rounds hold their pairs back for the proposer (it reads target features)."""
        return proposer_lib.holds_pairs(self._proposer)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
                 *, temperature=0.0, top_k=0, top_p=1.0, seed=None, frequency_penalty=0.0, presence_penalty=0.0,
                 repetition_penalty=1.0, logit_bias=None, logprobs=None, prompt_logprobs=None, trace: bool = False,
                 progress: bool | None = None, structured=None) -> list[Result]:
        """Continuation of each prompt (token ids), in input order; see `Result`. Any number of prompts
        runs through the engine's pool of `max_batch` slots: a finished row's slot takes the next prompt.

        temperature, top_k, top_p, seed: each a scalar for every prompt or a list with one per prompt.
        temperature 0 is greedy (the argmax; the other settings are then ignored); else the row samples
        from the target's distribution filtered as transformers' generate does (temperature, then top-k,
        then top-p; top_k 0 and top_p 1 mean no filter). seed None draws fresh entropy; an int in
        [0, 2**64) fixes the row's draws: with the same engine (drafter, gamma, proposal), its prompt,
        settings and seed give the same tokens whatever the other rows and whichever slot it runs in (in
        16-bit, other rows change a step's shapes, which can move a near-tie: docs/exactness.md). Under
        num_draft_tokens="auto" each call's gamma follows the whole request's acceptance and the measured
        costs, so a seed gives the same tokens only for the same request and cost table (the distribution is
        exact either way).
        frequency_penalty, presence_penalty (each in [-2, 2], 0: none), repetition_penalty (> 0, 1: none) and
        logit_bias (None, or a dict of token id -> bias in [-100, 100], at most 300 entries): vLLM's penalties (counts
        over the output; the repetition penalty over prompt and output) and OpenAI's bias, applied in that order to
        the target's logits before temperature, top-k and top-p (docs/sampling.md); each a scalar (a dict) for every
        prompt or a list with one per prompt; exact under speculation.
        logprobs: None, or k in [0, 20]: `Result.logprobs` holds each generated token's logprob and its position's k
        most likely tokens; prompt_logprobs: the same for the prompt's tokens (`Result.prompt_logprobs`), computed
        by the prompt's own prefill, whose prefix the cache then does not serve. Each a scalar or one per prompt.
        Bad values raise ValueError before any device work.
        Every token id, max_new_tokens, stop id, top_k and seed is an int (a numpy integer too; not a bool,
        not a float); a prompt is a list or tuple of them or a 1-D integer array, and prompts may be a 2-D
        integer array. Anything else raises ValueError naming the argument and the prompt index.
        trace=True also keeps each round's drafts and target choices (`Result.rounds`): they travel in
        the round's one transfer either way, so tracing adds no device work and no transfer.
        progress: a progress bar (prompts done, tokens/s) on stderr; None shows it when there are more
        prompts than slots.
        structured: an eagle3_jax.Structured for every prompt, or a list with one per prompt (None: a free row):
        a constrained row's output is the target's under the constraint's mask (docs/structured.md), and it ends
        at an end-of-sequence id its constraint allows, with finish_reason "stop" and the end id left out of
        token_ids."""
        request = self.request(prompts, max_new_tokens, stop_token_ids, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed, frequency_penalty=frequency_penalty,
                               presence_penalty=presence_penalty, repetition_penalty=repetition_penalty,
                               logit_bias=logit_bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                               structured=structured)
        results: list[Result | None] = [None] * request.num_rows
        for i, result in self._completed(request, trace, progress_lib.checked(progress)):
            results[i] = result
        return results

    def as_completed(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     stop_token_ids: Sequence[int] = (), *, trace: bool = False, progress: bool | None = False,
                     **settings) -> Iterator[tuple[int, Result]]:
        """(prompt index, Result) for each prompt as it finishes; the arguments (settings: the sampling, structured,
        penalty and logprobs keywords) are `generate`'s. Safe to abandon at any point. A bad request raises here,
        before any device work."""
        request = self.request(prompts, max_new_tokens, stop_token_ids, **settings)
        return self._completed(request, trace, progress_lib.checked(progress))

    def _completed(self, request: Request, trace: bool, progress: bool | None) -> Iterator[tuple[int, Result]]:
        P = request.num_rows
        tokens, accepts, gammas, traces, logprobs = ([[] for _ in range(P)] for _ in range(5))
        cached, prompt_logprobs = [0] * P, [None] * P
        bar = progress_lib.progress_bar(P, self._pool_rows(request), progress)
        try:
            for event in self._events(request, trace):
                i = event.request
                tokens[i].extend(event.tokens)
                cached[i] = max(cached[i], event.cached_tokens)
                logprobs[i].extend(event.logprobs or ())
                prompt_logprobs[i] = prompt_logprobs[i] or event.prompt_logprobs
                if event.gamma is not None:  # a speculative round
                    accepts[i].append(event.accepted)
                    gammas[i].append(event.gamma)
                    if event.trace is not None:
                        traces[i].append(round_trace(event.trace, event.accepted))
                if bar is not None:
                    bar.add(len(event.tokens), event.finished)
                if event.finished:
                    yield i, Result(tokens[i], event.finish_reason, accepts[i], traces[i] if trace else None,
                                    gammas[i], cached[i], logprobs[i] if _asks(request.logprobs, i) else None,
                                    prompt_logprobs[i] if _asks(request.prompt_logprobs, i) else None)
        finally:
            if bar is not None:
                bar.close()

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
               **settings) -> Iterator[tuple[int, list[int]]]:
        """Yields (prompt index, new tokens) as the pool's rounds emit them, in the order they ran; the
        settings are `generate`'s. Safe to abandon at any point, after which the engine serves the next
        request as usual. A bad request raises here, before the first chunk is asked for."""
        request = self.request(prompts, max_new_tokens, stop_token_ids, **settings)
        return ((e.request, e.tokens) for e in self._events(request) if e.tokens)

    def compile(self, *, samples: bool = False, top_k: int = 0, threads: int | None = None) -> int:
        """Compiles every program a pool of max_batch slots can run, without running them, so that no later
        request waits on XLA: at every row bucket (live_plan.row_buckets), the call of rounds of every gamma
        (under "auto", also holding its pairs) without prompt tokens and with them (a chunk in every round; an
        exact engine's chunk runs in a call of its own instead, compiled once), and the pool's gather and scatter
        of each bucket's rows; greedy, or when `samples` the sampling build that rows of this `top_k` take (0: the
        radix build, for any settings; 1 to 64, as Qwen3's 20: the candidate build; on a mesh the radix build
        either way). `threads` programs compile at once (None: one per CPU core; XLA's compiler releases the
        interpreter while it works). Under "auto" it also measures (or loads) the round costs of every bucket,
        with and without prompt tokens. With JAX's persistent compilation cache on (the CLI's and the server's
        default), a configuration compiled once before is not compiled or lowered again (decoding/warm_start.py):
        its programs load from the cache on first use, and its round costs from their file. Returns how many
        programs it compiled (0 then)."""
        template = self.request([[0]], 1, temperature=1.0 if samples else 0.0, top_k=top_k)
        spec = self.build_for(template)
        steps, pages = self.steps, self.page_pool
        params = (self.target.params, self.draft_params)
        stop_width, dtype = int(template.stop_ids.shape[1]), self.target.params["embed"].dtype
        marker = warm_start.marker({"spec": spec, "max_batch": self.max_batch, "rounds": self.rounds_per_call,
                                    "prefill_chunk": self.prefill_chunk, "sequences": self.prefill_sequences,
                                    "width": self.table_width, "pages": pages.num_pages, "page_size": pages.page_size,
                                    "dtype": str(dtype), "stop_width": stop_width, "auto": self.auto,
                                    "mesh": None if self.target.mesh is None else self.target.mesh.devices.shape})
        if warm_start.is_warm(marker):  # every program is in the persistent cache: each loads on first use
            return 0
        pool = steps.empty(self.spec, self.max_batch, self.table_width, stop_width, dtype)
        jobs = []  # (step, args, kwargs): compiled with real arrays, so that jit's cache keys match a call's
        pages.acquire()
        try:
            for bucket in live_plan.row_buckets(self.max_batch):
                rows = steps.empty(self.spec, bucket, self.table_width, stop_width, dtype)
                state = spec_round.with_pages(rows, pages.arrays)
                for mixed in (False,) if self.spec.exact else (False, True):
                    chunks = steps.put(self._empty_chunks(stop_width, bucket)) if mixed else None
                    jobs += [(steps.rounds, (*params, state, chunks),
                              dict(spec=dataclasses.replace(spec, gamma=call.gamma, flush=call.flush),
                                   num_rounds=self.rounds_per_call)) for call in self._calls(mixed)]
                if bucket < self.max_batch:
                    index = steps.put(np.arange(bucket, dtype=np.int32))
                    jobs += [(live.jit_take, (pool, index), {}), (live.jit_put, (pool, index, rows), {})]
            jobs.append((live.jit_release, (pool, steps.put(np.zeros((self.max_batch,), np.int32))), {}))
            if self.spec.exact:  # its chunks' call of their own, over the pool's slots
                chunk = jax.tree.map(lambda x: x[0], live.device_chunks(self._chunk_plan(stop_width, 1, alone=True)))
                jobs.append((steps.prefill, (*params, spec_round.with_pages(pool, pages.arrays), steps.put(chunk)),
                             dict(spec=self.prefill_build(spec))))
            with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as workers:
                list(workers.map(lambda job: parallel_steps.compile_ahead(job[0], *job[1], **job[2]), jobs))
        finally:
            pages.release()
        if self.auto:  # every bucket's round costs, measured now (or loaded) rather than on a request's first use
            for bucket in live_plan.row_buckets(self.max_batch):
                for mixed in (False, True):
                    self.round_costs(bucket, 0.0, template, mixed)
        warm_start.mark(marker, len(jobs))
        return len(jobs)

    def _chunk_plan(self, stop_width: int, rounds: int, alone: bool = False):
        """Chunks of no prompt token (live_plan.empty_chunk) at this engine's widths, one per round."""
        return live_plan.empty_chunk(self.prefill_chunk, self.prefill_sequences, self.table_width, stop_width,
                                     self.max_batch, alone, self.max_len if self.keeps_history else 0, rounds)

    def _empty_chunks(self, stop_width: int, bucket: int) -> spec_round.Chunk:
        """A mixed call's chunks of no prompt token, as the pool passes them to a call of `bucket` rows."""
        return live.device_chunks(self._chunk_plan(stop_width, self.rounds_per_call), np.arange(bucket),
                                  self.max_batch)

    @property
    def gammas(self) -> tuple[int, ...]:
        """The gammas calls of rounds may run: 0 .. max_draft_tokens under "auto", else the one."""
        return tuple(range(self.num_draft_tokens + 1)) if self.auto else (self.draft_depth,)

    @property
    def scratch(self) -> int:
        """Positions past the draft_depth + 1 it commits at most that a round writes past a row's committed KV: a
        tree's nodes and beams beyond its depth (TreeShape.reach), 0 for a chain."""
        return 0 if self.tree is None else max(0, self.tree.reach - (self.draft_depth + 1))

    def round_costs(self, batch: int, length: float, template: Request | None = None, mixed: bool = False):
        """Seconds of one call of rounds of each gamma in `gammas` at `batch` rows (a row bucket) and KV `length`,
        carrying a chunk of prompt tokens in every round when `mixed`, for the build and widths of `template` (a
        request; None: a greedy one with one stop id): the injected costs (`round_costs(batch, length)`, the same
        with prompt tokens and without), else round_costs.py's table for this configuration and device, measured on
        first use of a bucket (which compiles each gamma at it, as the request would)."""
        if self._given_costs is not None:
            return self._given_costs(batch, length)
        template = template or self.greedy_template()
        spec = self.build_for(template)
        build = spec.filter if spec.sampling else False  # each build its own costs: False greedy, else its filter
        if spec.penalties or spec.logprobs:  # ... and its variant with penalties or logprobs
            build = (build, spec.penalties, spec.logprobs)
        if build not in self._costs:
            fields = {"spec": dataclasses.replace(spec, gamma=0), "dtype": str(self.target.params["embed"].dtype),
                      "rounds_per_call": self.rounds_per_call, "gammas": self.gammas,
                      "prefill_chunk": self.prefill_chunk, "prefill_sequences": self.prefill_sequences}
            lengths = round_costs.grid_lengths(self.max_len, round_costs.margin(self.rounds_per_call,
                                                                                self.num_draft_tokens))
            self._costs[build] = round_costs.RoundCosts(round_costs.cache_key(fields), round_costs.default_folder(),
                                                        lengths, len(self.gammas))
        # The table's columns are `gammas` in order: column i times gamma gammas[i]; a bucket's key names whether its
        # calls carry prompt tokens.
        key = f"{batch}+chunks" if mixed else str(batch)
        return self._costs[build].seconds(key, length, lambda _, n, i: self.time_call(batch, n, self.gammas[i],
                                                                                      template, mixed=mixed))

    def greedy_template(self) -> Request:
        """A one-row greedy request: what build_for takes to name the greedy build."""
        return Request.build([[0]], 1, (0,), max_len=self.max_len, vocab_size=self.target.config.vocab_size)

    def _calls(self, mixed: bool = False) -> list[gamma_policy.Call]:
        """Every call of rounds this engine can run: each gamma, and under "auto" gamma 0 holding its pairs, but in a
        call that carries prompt tokens (whose chunks read the drafter's weights anyway: it flushes)."""
        holding = [gamma_policy.Call(0, False)] if self.auto and self._holds and not mixed else []
        return [gamma_policy.Call(g) for g in self.gammas] + holding

    def time_call(self, batch: int, length: int, gamma: int, template: Request | None = None,
                  flush: bool | None = None, mixed: bool = False) -> float:
        """Seconds per call of rounds of `gamma` over a bucket of `batch` rows (a dummy pool's) at KV `length`,
        carrying a chunk's tokens in every round when `mixed` (chunks of no sequence: the forward's
        width is the same whatever they hold), of the template request's build and widths (None: greedy, one stop
        id): the pool's own compiled call; not in `device_events`, which records requests. flush None at gamma 0
        under "auto": the mean over a cycle of FLUSH_CALLS calls, one of which flushes (a call that carries prompt
        tokens always flushes). The rows read the engine's own pages and write nothing (round_costs.timing_pool), so
        a pool's sequences keep their keys; not while a pool runs on another thread."""
        template = template or self.greedy_template()
        if flush is None and gamma == 0 and self.auto and self._holds and not mixed:
            hold, catch_up = (self.time_call(batch, length, 0, template, f) for f in (False, True))
            return ((gamma_policy.FLUSH_CALLS - 1) * hold + catch_up) / gamma_policy.FLUSH_CALLS
        spec = dataclasses.replace(self.build_for(template), gamma=gamma, flush=flush is not False)
        params, pages, steps = (self.target.params, self.draft_params), self.page_pool, self.steps
        stop_width = int(template.stop_ids.shape[1])
        rows = steps.empty(self.spec, batch, self.table_width, stop_width, self.target.params["embed"].dtype)
        table = round_costs.timing_table(batch, pages.num_pages, self.table_width)
        state = round_costs.timing_pool(spec_round.with_pages(rows, pages.arrays), steps.put(table), length,
                                        self.target.config.vocab_size, self.max_len)
        chunks = steps.put(self._empty_chunks(stop_width, batch)) if mixed else None
        seconds, state = round_costs.time_calls(
            # The engine's own steps (sharded on a mesh), its arguments passed as the pool passes them (by
            # position): jit keys its cache on how arguments are passed.
            lambda s: steps.rounds(*params, s, chunks, spec=spec, num_rounds=self.rounds_per_call), state)
        _, pages.arrays = spec_round.split_pages(state)
        return seconds

    @property
    def keeps_history(self) -> bool:
        """Whether the proposer keeps a token history a chunk must bring whole (prompt lookup)."""
        return self._proposer is not None and self._proposer.keeps_history

    @property
    def holds_pairs(self) -> bool:
        """Whether a gamma-0 call holds its committed pairs back from the proposer (EAGLE-3's drafter) until a
        flushing call brings it up to date (gamma_policy.Auto's `holds`)."""
        return self._holds

    def request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
                *, structured=None, **settings) -> Request:
        """The request `generate` runs for these arguments (settings: its sampling, penalty and logprobs keywords),
        checked against this engine's max_len and the target's vocabulary (and its constraints compiled), and
        against what the engine can honour (`check_outputs`); raises ValueError before any device work."""
        self.device_events = []  # a request refused here did nothing on the device
        constraints = None
        if structured is not None:
            count = len(prompts) if isinstance(prompts, (list, tuple)) or hasattr(prompts, "shape") else 0
            given = structured if isinstance(structured, (list, tuple)) else [structured] * count
            if len(given) != count:
                raise ValueError(f"structured has {len(given)} values for {count} prompts")
            constraints = [None if s is None else self.constraint(s) for s in given]
        request = Request.build(prompts, max_new_tokens, stop_token_ids, max_len=self.max_len,
                                vocab_size=self.target.config.vocab_size, constraints=constraints, **settings)
        self.check_outputs(request)
        return request

    def constraint(self, structured):
        """A Structured compiled for the target's vocabulary (decoding/automaton.py), cached by its text: the
        target folder's tokenizer and its end-of-sequence ids (generation_config.json's, else the tokenizer's).
        ValueError for anything that is not a Structured, a target without a tokenizer, an engine on a mesh, or a
        constraint that does not compile."""
        if not isinstance(structured, Structured):
            raise ValueError(f"structured must be an eagle3_jax.Structured or None, got {type(structured).__name__}")
        if self._spec.tp is not None:
            raise ValueError("structured outputs are not supported on a tensor-parallel mesh")
        if self._compiler is None:
            self._compiler = Compiler(target_vocabulary(self.target.folder, self.target.config.vocab_size))
        return self._compiler(structured)

    def _pool_rows(self, request: Request) -> int:
        """The slots a request runs in: max_batch, or fewer when it has fewer prompts."""
        return min(self.max_batch, request.num_rows)

    def _events(self, request: Request, trace: bool = False) -> Iterator[live_plan.Event]:
        """The request's events (Event.request: the prompt's index) from a live pool of its own: every prompt
        submitted at once into max_batch slots (each call computes the bucket of rows it runs). Closing the iterator
        aborts what is left; a device failure in the pool raises here."""
        self.device_events = []
        pool = live.LivePool(self, int(request.stop_ids.shape[1]), trace=trace, events=self.device_events)
        arrived: queue.SimpleQueue = queue.SimpleQueue()
        try:
            pool.submit_all(live_plan.request_rows(request, self.max_len), arrived.put)
            left = request.num_rows
            while left:
                event = arrived.get()
                if event.finish_reason == "error":
                    raise pool.error
                left -= event.finished
                yield event
        finally:
            pool.close()
            self.preemptions += pool.preemptions
            self.cached_tokens += pool.cached_tokens


def _asks(counts, row: int) -> bool:
    """Whether a request's row asks for logprobs (Request.logprobs or prompt_logprobs)."""
    return counts is not None and int(counts[row]) >= 0
