"""`make demo`: speculative decoding end to end on the CPU, with checkpoints in the real file layouts.

The target is a transformers Qwen3 saved with `save_pretrained`; the drafter is written in
SpecForge's layout (`config.json` + `model.safetensors`: fc, midlayer.*, norm, lm_head, d2t, t2d).
Random weights would give a drafter that is never right, so both are built with a known structure:
the target's greedy next token is a fixed permutation pi of the current token (its attention and MLP
outputs are zeroed, so the residual stream is the token's one-hot embedding), and the drafter reads
the captured low feature and predicts pi(pi(x)), the token after next. Its first draft each round is
therefore right and the rest are not: tau = 2 for every gamma, whatever the machine.
"""

from __future__ import annotations

import collections
import json
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB = HIDDEN = 256
LAYERS = 8


def permutation(seed: int = 0) -> np.ndarray:
    order = np.random.default_rng(seed).permutation(VOCAB)
    pi = np.empty(VOCAB, np.int64)
    pi[order] = np.roll(order, -1)  # one cycle through the whole vocabulary
    return pi


def _head_for(mapping: np.ndarray) -> np.ndarray:
    """lm_head rows such that argmax(head @ onehot(x)) = mapping[x]."""
    head = np.zeros((VOCAB, HIDDEN), np.float32)
    head[mapping, np.arange(VOCAB)] = 1.0
    return head


def build_target(folder: Path, pi: np.ndarray) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                      max_position_embeddings=1024)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB))
        model.lm_head.weight.copy_(torch.from_numpy(_head_for(pi)))
    model.save_pretrained(folder)


def build_drafter(folder: Path, pi: np.ndarray) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    D, H, heads, kv, inter = HIDDEN, 32, 8, 2, 2 * HIDDEN

    def rand(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    fc = np.zeros((D, 3 * D), np.float32)
    fc[:, :D] = np.eye(D)  # keep the low feature: the one-hot of the captured token
    tensors = {
        "fc.weight": fc,
        "midlayer.hidden_norm.weight": np.ones(D, np.float32),
        "midlayer.input_layernorm.weight": np.ones(D, np.float32),
        "midlayer.post_attention_layernorm.weight": np.ones(D, np.float32),
        "midlayer.self_attn.q_proj.weight": rand(heads * H, 2 * D),
        "midlayer.self_attn.k_proj.weight": rand(kv * H, 2 * D),
        "midlayer.self_attn.v_proj.weight": rand(kv * H, 2 * D),
        "midlayer.self_attn.o_proj.weight": np.zeros((D, heads * H), np.float32),
        "midlayer.mlp.gate_proj.weight": rand(inter, D),
        "midlayer.mlp.up_proj.weight": rand(inter, D),
        "midlayer.mlp.down_proj.weight": np.zeros((D, inter), np.float32),
        "norm.weight": np.ones(D, np.float32),
        "lm_head.weight": _head_for(pi[pi]),
        "d2t": np.zeros(VOCAB, np.int64),
        "t2d": np.ones(VOCAB, bool),
    }
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": D, "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": H, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": VOCAB,
              "draft_vocab_size": VOCAB, "hidden_act": "silu", "max_position_embeddings": 1024}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _timed(engine, prompts, max_new):
    engine.generate(prompts, max_new)  # compile outside the timing
    start = time.perf_counter()
    results = engine.generate(prompts, max_new)
    return results, time.perf_counter() - start


def main() -> None:
    import eagle3_jax

    pi = permutation()
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [27, 18, 28]]
    max_new = 64
    with tempfile.TemporaryDirectory() as tmp:
        build_target(Path(tmp) / "target", pi)
        build_drafter(Path(tmp) / "drafter", pi)
        target = eagle3_jax.load_target(Path(tmp) / "target", dtype="float32")
        drafter = eagle3_jax.load_drafter(Path(tmp) / "drafter", target, dtype="float32")
        plain, t_plain = _timed(eagle3_jax.Engine(target, max_len=256), prompts, max_new)
        print(f"spec off : {sum(len(r.token_ids) for r in plain) / t_plain:8.1f} tokens/s")
        for gamma in (1, 3, 5):
            engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=gamma, max_len=256)
            spec, t_spec = _timed(engine, prompts, max_new)
            assert [r.token_ids for r in spec] == [r.token_ids for r in plain], "speculative output differs"
            accepts = [a for r in spec for a in r.accept_lengths]
            tau = float(np.mean(np.asarray(accepts) + 1))
            hist = collections.Counter(accepts)
            print(f"gamma {gamma}  : {sum(len(r.token_ids) for r in spec) / t_spec:8.1f} tokens/s, tau {tau:.2f}, "
                  f"accepted-drafts histogram {dict(sorted(hist.items()))}; output identical to spec off")
    print("first prompt's continuation:", plain[0].token_ids[:16], "...")


if __name__ == "__main__":
    main()
