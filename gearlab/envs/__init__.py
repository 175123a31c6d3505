"""Environments for multi-turn episodes: the interface (:mod:`.base`), tools (:mod:`.tools`), the
sandbox for model-written code (:mod:`.sandbox`) and the token-in/token-out rollout loop
(:mod:`.multiturn`)."""
