"""Decoding: a checked request (`request`), the jitted prefill and speculative round (`spec_round`), the
layout of what a round reports (`round_output`), and the host loop around them (`engine`)."""
