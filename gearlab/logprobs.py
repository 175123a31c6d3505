"""Stable import path of the chunked log-prob / entropy / KL functions, which live in ``gearlab.core.logprobs``."""
from gearlab.core.logprobs import (naive_token_logprobs, position_ids_from_mask, response_hidden,  # noqa: F401
                                   token_kl, token_logprobs)
