"""Decoding: the jitted prefill and speculative round (`spec_round`) and the host loop around them
(`engine`)."""
