"""Rollout engines: the shared protocols and sampling settings (``base``), single-turn sampling with HF
``generate`` (``hf``), the multi-turn token-in/token-out loop with environments (``multiturn``), a colocated vLLM
token generator (``vllm``), and the factory that picks one for a run (``factory``). Depends on ``core``,
``tasks``, ``envs`` and ``parallel``."""
