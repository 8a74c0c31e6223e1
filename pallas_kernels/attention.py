"""The attention ops the model calls: reference, decode/verify, prefill."""

from pallas_kernels.decode_attention import DecodeConfig, decode_attention
from pallas_kernels.prefill_attention import PrefillConfig, prefill_attention
from pallas_kernels.reference import attention_reference

__all__ = ["attention_reference", "decode_attention", "prefill_attention", "DecodeConfig", "PrefillConfig"]
