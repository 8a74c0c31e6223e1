"""The models as pure functions over parameter pytrees: the Qwen3 target, the EAGLE-3 drafter, and the
layers, attention, KV cache and kernel choice they share."""
