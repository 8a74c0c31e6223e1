"""Engine's constructor arguments, checked before anything is allocated: each a clear ValueError naming the
argument and what it takes."""

from __future__ import annotations

import dataclasses

from eagle3_jax.decoding import tree as tree_lib
from eagle3_jax.decoding.request import is_int
from eagle3_jax.models import kernels as kernels_lib

# Engine(max_len=None)'s capacity, where the target's limit allows it; the CLI and the server take it too. With paged
# KV it bounds one sequence (its page table's width), not the memory a slot reserves.
DEFAULT_MAX_LEN = 4096
DEFAULT_MAX_DRAFT_TOKENS = 3  # num_draft_tokens="auto" chooses among gamma 0 .. this by default
MAX_AUTO_DRAFT_TOKENS = 16  # "auto" compiles a step per gamma: more would mostly compile steps never chosen


PROPOSALS = ("argmax", "sample")  # how a sampled row's drafts are proposed (Engine's `proposal`)
# Both are lossless; which accepts more depends on the drafter. "argmax" is what vLLM, SGLang and tpu-inference do,
# and needs no filter over the draft vocabulary per draft step.
DEFAULT_PROPOSAL = "argmax"


@dataclasses.dataclass(frozen=True)
class Names:
    """How a caller spells the gamma arguments in its errors: Engine's keywords (ENGINE) or the CLI's flags
    (FLAGS), so that both take their rules from check_gamma."""

    num_draft_tokens: str
    auto: str  # num_draft_tokens set to "auto"
    max_draft_tokens: str
    optional: str  # how max_draft_tokens is left out
    need_drafter: str  # what to do when "auto" has no proposer
    on_mesh: str  # what to do when "auto" meets a mesh
    draft_depth: str
    draft_top_k: str


ENGINE = Names("num_draft_tokens", "num_draft_tokens='auto'", "max_draft_tokens", "None",
               "it needs a drafter", "with a mesh, give num_draft_tokens an int", "draft_depth", "draft_top_k")
FLAGS = Names("--num-draft-tokens", "--num-draft-tokens auto", "--max-draft-tokens", "unset",
              "pass --drafter or --prompt-lookup", "with --tp give it an int", "--draft-depth", "--draft-top-k")


def check_gamma(has_drafter: bool, num_draft_tokens, max_draft_tokens, on_mesh: bool = False,
                names: Names = ENGINE) -> tuple[int, bool]:
    """(the gamma, or under "auto" the largest gamma; whether it is "auto"). The int itself is checked by
    `check_sizes`. on_mesh: the engine runs tensor parallel, where "auto" is refused."""
    if isinstance(num_draft_tokens, str):
        if num_draft_tokens != "auto":
            raise ValueError(f"{names.num_draft_tokens} must be an int or 'auto', got {num_draft_tokens!r}")
        if not has_drafter:
            raise ValueError(f"{names.auto} chooses how many tokens the drafter drafts: {names.need_drafter}")
        if on_mesh:
            raise ValueError(f"{names.auto} runs on one device (its round costs and held pairs are one device's): "
                             f"{names.on_mesh}")
        G = DEFAULT_MAX_DRAFT_TOKENS if max_draft_tokens is None else max_draft_tokens
        if not is_int(G) or not 1 <= G <= MAX_AUTO_DRAFT_TOKENS:
            raise ValueError(f"{names.max_draft_tokens} must be {names.optional} or an int in "
                             f"[1, {MAX_AUTO_DRAFT_TOKENS}], got {max_draft_tokens!r}")
        return int(G), True
    if max_draft_tokens is not None:
        raise ValueError(f"{names.max_draft_tokens} is for {names.auto}; with {names.num_draft_tokens} "
                         f"{num_draft_tokens!r} leave it {names.optional} (got {max_draft_tokens!r})")
    return (int(num_draft_tokens) if is_int(num_draft_tokens) else num_draft_tokens), False


def check_tree(drafts_trees: bool, num_draft_tokens, draft_depth, draft_top_k, *, auto: bool,
               proposal: str = "argmax", exact: bool = False, on_mesh: bool = False,
               names: Names = ENGINE) -> tree_lib.TreeShape | None:
    """The draft tree of (num_draft_tokens, draft_depth, draft_top_k), num_draft_tokens already checked (an int >= 1,
    or "auto"): None for a chain (draft_top_k 1, draft_depth None or num_draft_tokens), else its shape
    (decoding/tree.py). A tree needs an EAGLE-3 drafter (drafts_trees: the proposer has `propose_tree`) and is
    refused with "auto"
    (its policy models a chain's acceptance, one draft a position, which says nothing of a tree's paths),
    proposal="sample" (a tree's drafts are the drafter's top-k, not drawn), exact=True (its attention kernel has no
    tree mask) and a mesh (its tree steps are one device's, untested sharded)."""
    k, d = names.draft_top_k, names.draft_depth
    if not is_int(draft_top_k) or draft_top_k < 1:
        raise ValueError(f"{k} must be a positive int, got {draft_top_k!r}")
    if draft_depth is not None and (not is_int(draft_depth) or draft_depth < 1):
        raise ValueError(f"{d} must be {names.optional} or a positive int, got {draft_depth!r}")
    if draft_top_k == 1:
        if draft_depth is not None and (auto or draft_depth != num_draft_tokens):
            raise ValueError(f"{k}=1 drafts a chain, as deep as {names.num_draft_tokens}: leave {d} {names.optional} "
                             f"or give it {names.num_draft_tokens}, got {d}={draft_depth!r} and "
                             f"{names.num_draft_tokens}={num_draft_tokens!r}")
        return None
    tree = f"{k}={draft_top_k} drafts a tree"
    if not drafts_trees:
        raise ValueError(f"{tree} from the top-k tokens of an EAGLE-3 drafter: give one (load_drafter)")
    if auto:
        raise ValueError(f"{tree}: {names.auto} chooses a chain's gamma (its acceptance model is one draft a "
                         f"position, which says nothing of a tree's paths); give {names.num_draft_tokens} an int")
    if draft_depth is None:
        raise ValueError(f"{tree}: give {d}, its drafting steps (at most {names.num_draft_tokens})")
    if problem := tree_lib.shape_problem(num_draft_tokens, draft_depth, draft_top_k):
        raise ValueError(problem.replace("num_draft_tokens", names.num_draft_tokens).replace(
            "draft_depth", d).replace("draft_top_k", k))
    if proposal != "argmax":
        raise ValueError(f"{tree}, verified by the multi-draft rule for argmax drafts: proposal={proposal!r} draws "
                         f"one chain from the drafter's q; use proposal='argmax' with a tree")
    if exact:
        raise ValueError(f"{tree}: exact=True's attention kernel has no tree mask; use {k}=1 with exact=True")
    if on_mesh:
        raise ValueError(f"{tree} on one device: with a tensor-parallel mesh use {k}=1")
    return tree_lib.TreeShape(int(num_draft_tokens), int(draft_depth), int(draft_top_k))


def check_proposal(proposal) -> None:
    if proposal not in PROPOSALS:
        raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")


def check_sizes(cfg, has_drafter: bool, num_draft_tokens, max_len, rounds_per_call) -> int:
    """Engine's int arguments, each an int (a numpy integer too, never a bool) in its range; returns
    max_len, None resolved to the default that fits the target."""
    limit = cfg.max_position_embeddings
    max_len = min(DEFAULT_MAX_LEN, limit) if max_len is None else max_len
    if not is_int(max_len) or not 2 <= max_len <= limit:
        raise ValueError(f"max_len must be None or an int in [2, max_position_embeddings={limit}], got {max_len!r}")
    least = 1 if has_drafter else 0
    if not is_int(num_draft_tokens) or num_draft_tokens < least:
        raise ValueError(f"num_draft_tokens must be an int >= {least}{' with a drafter' if has_drafter else ''}, "
                         f"got {num_draft_tokens!r}")
    # More rounds than max_len can never emit a token: every round emits one per live row.
    if not is_int(rounds_per_call) or not 1 <= rounds_per_call <= max_len:
        raise ValueError(f"rounds_per_call must be an int in [1, max_len={max_len}], got {rounds_per_call!r}")
    return int(max_len)


def check_exact(cfg, exact) -> None:
    if not isinstance(exact, bool):
        raise ValueError(f"exact must be a bool, got {exact!r}")
    if not exact:
        return
    if not kernels_lib.invariant_attention_supports(cfg.head_dim):
        raise ValueError(f"exact=True needs a power-of-two head_dim >= 16 (its attention kernel), got {cfg.head_dim}")
    if cfg.moe is not None:
        raise ValueError("exact=True is for dense targets: the expert layers have no row-invariant kernels")
    _exact_shapes(cfg)


def _exact_shapes(cfg) -> None:
    """exact=True's matmul (pallas_kernels/skinny_matmul.py) needs every target weight's output size to be a
    multiple of 16 and its input size at least 16."""
    D, H, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    outputs = {"q/k/v": (cfg.num_heads + 2 * cfg.num_kv_heads) * H, "o": D, "gate/up": 2 * I, "down": D,
               "lm_head": cfg.vocab_size}
    bad = [f"{name} {n}" for name, n in outputs.items() if n % 16] + [
        f"input {k}" for k in (D, cfg.num_heads * H, I) if k < 16]
    if bad:
        raise ValueError(f"exact=True needs target weights with outputs a multiple of 16 and inputs >= 16: {bad}")


def check_pages(kv_tokens, page_size, max_len: int) -> None:
    """kv_tokens (None, or an int of at least max_len: one whole sequence must fit) and page_size (None, or a
    positive int); checked before anything is allocated."""
    if page_size is not None and (not is_int(page_size) or page_size < 1):
        raise ValueError(f"page_size must be None or a positive int, got {page_size!r}")
    if kv_tokens is not None and (not is_int(kv_tokens) or kv_tokens < max_len):
        raise ValueError(f"kv_tokens must be None or an int of at least max_len={max_len} (one whole sequence "
                         f"fits), got {kv_tokens!r}")


def check_max_batch(max_batch) -> None:
    if max_batch is not None and (not is_int(max_batch) or max_batch < 1):
        raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")


def check_prefill(prefill_chunk, prefill_sequences, prefix_caching) -> None:
    """prefill_chunk (None or a positive int), prefill_sequences (None or a positive int) and prefix_caching (a
    bool)."""
    if prefill_chunk is not None and (not is_int(prefill_chunk) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
    if prefill_sequences is not None and (not is_int(prefill_sequences) or prefill_sequences < 1):
        raise ValueError(f"prefill_sequences must be None or a positive int, got {prefill_sequences!r}")
    if not isinstance(prefix_caching, bool):
        raise ValueError(f"prefix_caching must be a bool, got {prefix_caching!r}")
