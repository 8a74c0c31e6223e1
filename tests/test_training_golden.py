"""The training-time test against SpecForge's own training forward (`OnlineEagle3Model`, sdpa backend, float32):
the same drafter weights, features, tokens, target logits and loss mask give the same per-step losses and
accuracies, the same weighted loss and the same gradients."""

import contextlib
import importlib
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

import eagle3_jax
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.models.config import Qwen3Config
from eagle3_jax.training import ttt

import drafter_oracle as oracle

HT, VT, LAYERS = 48, 200, 8
SPEC = oracle.DraftSpec(hidden_size=HT, intermediate_size=80, num_heads=4, num_kv_heads=2, head_dim=16,
                        target_hidden_size=HT, target_vocab_size=VT, draft_vocab_size=120, rope_theta=1e4)
STEPS, DECAY = 4, 0.8


def fake_target(embed: np.ndarray) -> Target:
    """A target that only carries its embedding: all the drafter reads of it."""
    cfg = Qwen3Config.from_dict({"model_type": "qwen3", "vocab_size": VT, "hidden_size": HT, "intermediate_size": 64,
                                 "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "head_dim": 12})
    return Target(cfg, {"embed": jnp.asarray(embed)}, folder=None)


def import_specforge_eagle3():
    """specforge.algorithms.eagle3.model, whose loss module imports triton (a GPU package) at the top for
    its fused kernel. Stand-ins for triton are in sys.modules only while that module imports; the tests
    use SpecForge's own torch reference of the same loss (`specforge.core.loss._compute_loss`)."""
    if "specforge.algorithms.eagle3.model" in sys.modules:
        return sys.modules["specforge.algorithms.eagle3.model"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("specforge.core.compact_teacher", "specforge.core.lk_loss", "specforge.core.eagle3_adapters",
                     "specforge.modeling.draft", "specforge.utils"):
            importlib.import_module(name)  # these pull in torch.compile's machinery before triton is faked

        class _Stub(types.ModuleType):
            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return type(name, (), {})

        triton = _Stub("triton")
        triton.jit = lambda f: f
        triton.language = _Stub("triton.language")
        sys.modules.update({"triton": triton, "triton.language": triton.language})
        try:
            loss = importlib.import_module("specforge.core.loss")
        finally:
            sys.modules.pop("triton")
            sys.modules.pop("triton.language")
        model = importlib.import_module("specforge.algorithms.eagle3.model")
    model.LogSoftmaxLoss = types.SimpleNamespace(apply=loss._compute_loss)
    return model


@contextlib.contextmanager
def eager():
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def specforge_draft(state, embed):
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    model = LlamaForCausalLMEagle3(LlamaConfig.from_dict(oracle.specforge_config_dict(SPEC)),
                                   attention_backend="sdpa").float()
    missing, unexpected = model.load_state_dict({**state, "embed_tokens.weight": embed}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model.freeze_embedding()
    return model


def batch(seed=0, B=2, T=13, lengths=(13, 9)):
    """Raw sequences (tokens, the target's logits and features at each position, per-token loss mask), with
    row 1 right-padded, each row's last real token unmasked as SpecForge's data normaliser does, and some
    target argmaxes outside the draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VT, (B, T), generator=g)
    logits = torch.randn(B, T, VT, generator=g) * 3
    features = torch.randn(B, T, 3 * HT, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    attention = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, n - 1:] = 0
        attention[b, :n] = 1
    return tokens, logits, features, mask, attention


def plant_hits(drafter, target, tokens, logits, features, mask, attention):
    """Raises the target's logit at the drafter's own step-0 guess on every other row, so that step 0's
    accuracy is neither 0 nor 1."""
    ids, _, _ = ttt.specforge_layout(jnp.asarray(tokens.numpy()), jnp.zeros(logits.shape), mask)
    p, cfg = drafter.params, drafter.config
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    h = ttt.project_features(p, cfg, jnp.asarray(features.numpy()))
    out, _, _ = ttt.drafter_step(p, cfg, target.params["embed"], h, ids, positions, (), ())
    guess = np.asarray(jnp.argmax(ttt.draft_logits(p, cfg, out), -1))
    guess = guess + np.asarray(p["d2t"])[guess]
    logits = logits.clone()
    for b in range(B):
        for t in range(0, T - 1, 2):  # row t is taught the logits at t + 1
            logits[b, t + 1, int(guess[b, t])] = 30.0
    return tokens, logits, features, mask, attention


def specforge_run(state, embed, tokens, logits, features, mask, attention):
    """SpecForge's online step: TargetHead.preprocess's shift (specforge.utils.padding), OnlineEagle3Model's
    TTT, the 0.8**k weighting of Eagle3TrainStrategy; then backward."""
    from specforge.utils import padding

    model_lib = import_specforge_eagle3()
    draft = specforge_draft(state, embed)
    model = model_lib.OnlineEagle3Model(draft, length=STEPS, attention_backend="sdpa")
    with eager():
        plosses, _, acces, *_ = model(input_ids=padding(tokens, left=False), attention_mask=attention,
                                      target=padding(logits, left=False), loss_mask=mask[..., None],
                                      hidden_states=features)
        loss = sum(DECAY**i * p for i, p in enumerate(plosses))
        loss.backward()
    grads = {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}
    return [float(p.detach()) for p in plosses], [float(a) for a in acces], float(loss.detach()), grads


def our_run(drafter, target, tokens, logits, features, mask):
    ids, teacher, loss_mask = ttt.specforge_layout(*(jnp.asarray(x.numpy()) for x in (tokens, logits, mask)))
    d2t = drafter.params["d2t"]

    def objective(trainable):
        losses, accs = ttt.ttt_losses({**trainable, "d2t": d2t}, drafter.config, target.params["embed"],
                                      jnp.asarray(features.numpy()), ids, teacher, loss_mask, STEPS)
        return ttt.weighted_loss(losses, DECAY), (losses, accs)

    (loss, (losses, accs)), grads = jax.value_and_grad(objective, has_aux=True)(
        {k: v for k, v in drafter.params.items() if k != "d2t"})
    return np.asarray(losses), np.asarray(accs), float(loss), grads


def rel_err(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(ours - ref)) / np.max(np.abs(ref))


def as_ours(grads):
    """SpecForge's gradient names and layout -> ours (q/k/v and gate/up fused along the output)."""
    m = "midlayer."

    def cat(*names):
        return torch.cat([grads[m + n] for n in names])

    return {"fc": grads["fc.weight"], "hidden_norm": grads[m + "hidden_norm.weight"],
            "embed_norm": grads[m + "input_layernorm.weight"],
            "wqkv": cat(*(f"self_attn.{x}_proj.weight" for x in "qkv")),
            "wo": grads[m + "self_attn.o_proj.weight"], "mlp_norm": grads[m + "post_attention_layernorm.weight"],
            "w_gate_up": cat("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            "w_down": grads[m + "mlp.down_proj.weight"],
            "final_norm": grads["norm.weight"], "lm_head": grads["lm_head.weight"]}


def test_ttt_losses_accuracies_and_gradients_match_specforge(tmp_path):
    state = oracle.random_drafter_state(SPEC, seed=3)
    embed = torch.randn(VT, HT, generator=torch.Generator().manual_seed(4)) * 0.5
    oracle.write_specforge(tmp_path / "drafter", SPEC, state)
    target = fake_target(embed.numpy())
    drafter = eagle3_jax.load_drafter(tmp_path / "drafter", target, dtype="float32")
    inputs = plant_hits(drafter, target, *batch())
    ref_losses, ref_accs, ref_loss, ref_grads = specforge_run(state, embed, *inputs)
    losses, accs, loss, grads = our_run(drafter, target, *inputs[:4])
    assert 0.2 < ref_accs[0] < 0.9  # some hits and some misses: the accuracy is tested, not a trivial 0
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(accs, ref_accs, rtol=1e-4, atol=1e-7)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)
    ref = as_ours(ref_grads)
    assert set(ref) == set(grads)
    for name, g in ref.items():
        assert rel_err(grads[name], g.numpy()) < 1e-4, name
