"""Checkpoints -> parameter pytrees: Hugging Face safetensors folders and our orbax conversions, for
targets and drafters (SpecForge, AngelSlim and speculators layouts)."""
