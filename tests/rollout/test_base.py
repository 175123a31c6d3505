"""The token-generator protocol declares everything the trainer calls, and the engines implement it."""
from __future__ import annotations

import re
from pathlib import Path

from gearlab.rollout.base import TokenGenerator
from gearlab.rollout.vllm import VLLMGenerator

ROOT = Path(__file__).resolve().parents[2]


def _members(cls) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")}


def test_protocol_declares_every_call_the_trainer_and_engines_make():
    declared = _members(TokenGenerator)
    called = set()
    for f in (ROOT / "gearlab").rglob("*.py"):
        called |= set(re.findall(r"\bself\.generator\.(\w+)\(", f.read_text()))
    assert called, "no generator call found: the scan is broken"
    assert called <= declared, f"called but not in the protocol: {sorted(called - declared)}"
    assert {"sample", "release", "mark_stale", "stats"} <= declared


def test_vllm_generator_implements_the_protocol():
    missing = _members(TokenGenerator) - set(dir(VLLMGenerator))
    assert not missing, missing
    g = object.__new__(VLLMGenerator)  # no engine built: the structural check needs none
    assert isinstance(g, TokenGenerator)


def test_sampling_at_temperature_zero_is_refused_unless_greedy():
    """logits / 0 give a NaN softmax, from which the fast sampler would return an id past the vocabulary."""
    import pytest

    from gearlab.rollout.base import SamplingParams

    with pytest.raises(ValueError, match="temperature 0.0 needs greedy=True"):
        SamplingParams(temperature=0.0)
    assert SamplingParams(temperature=0.0, greedy=True).greedy
