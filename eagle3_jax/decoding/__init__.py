"""Decoding: a checked request (`request`), the jitted prefill and speculative round (`spec_round`), the
layout of what a round reports (`round_output`), the choice of gamma per call under num_draft_tokens="auto"
(`gamma_policy`, `round_costs`), the host loop around them (`scheduler`, `engine`), and the live pool that
serves requests arriving while it runs (`live_plan`, `live`)."""
