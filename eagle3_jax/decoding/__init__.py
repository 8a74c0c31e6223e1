"""Decoding: a checked request (`request`), the jitted prefill and speculative round (`spec_round`; a draft tree's
shape, choice and acceptance, `tree`), the layout of what a round reports (`round_output`), the choice of gamma per
call under num_draft_tokens="auto" (`gamma_policy`, `round_costs`), the pool of slots that runs requests, those
arriving while it runs included (`live_plan`, its scheduler; `live`, its runner), and the engine that `generate`s
through such a pool (`engine`)."""
