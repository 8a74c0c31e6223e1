"""The OpenAI-compatible HTTP server over a live pool (`eagle3-jax serve`; docs/serving.md)."""
