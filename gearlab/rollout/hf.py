"""Rollout engine on Hugging Face ``generate``: G samples per prompt, token-in/token-out.

The sampled token ids are kept exactly as generated (no decode → re-encode round trip); text is
decoded only to score it. Sampling uses the per-row seeded draw of the fast decoder and vLLM
(``gearlab.rollout.sampler``, a logits processor in front of greedy selection): row i of a call draws with seed
``seed + i``, so a row's sample does not depend on the other rows of its batch, on the batch size or on how many
ranks share the batch, never touches torch's global RNG, and equals the fast decoder's wherever their logits agree.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn
from transformers import LogitsProcessor

from gearlab.core.batch import RolloutBatch
from gearlab.parallel.distributed import global_max_int
from gearlab.rollout.base import (STATIC_PAD, SamplingParams, TokenGenerator, idle_prompt, left_pad, pad_left_to,
                                  row_seeds, sibling_demonstrations, sibling_reprompt, stop_token_ids, trim_left)
from gearlab.rollout.sampler import sample_rows
from gearlab.tasks.base import Problem, Task


class HFRolloutEngine:
    """Batched sampling with ``model.generate``; rewards from the task."""

    def __init__(self, tokenizer, task: Task, *, batch_size: int = 64, reward_errors: str = "zero",
                 generator: TokenGenerator | None = None, static_cache: bool = False) -> None:
        self.tok = tokenizer
        self.generator = generator  # None: HF generate on the policy itself
        # HF generate with a static KV cache, which transformers compiles on GPUs (CUDA-graphed decode steps);
        # prompts are left-padded to a multiple of STATIC_PAD so a few shapes recur and compile once
        self.static_cache = static_cache
        self.task = task
        self.batch_size = batch_size
        self.reward_errors = reward_errors
        self.last_reward_errors = 0
        # sharded (FSDP) policies: every rank must run the same number of forward passes, so generate()
        # keeps stepping until all ranks are done (HF ``synced_gpus``)
        self.synced_gpus = False

    def encode_prompts(self, problems: Sequence[Problem], *, privileged: bool | str = False) -> tuple[Tensor, Tensor]:
        """Chat-formatted, left-padded prompt ids and mask [N, P]."""
        return left_pad([self._encode_chat(self.task.messages(p, privileged=privileged)) for p in problems],
                        self.tok.pad_token_id)

    def _encode_chat(self, msgs: list[dict[str, str]]) -> list[int]:
        """One chat's prompt ids (the chat template with the generation prompt; plain lines without a template)."""
        if getattr(self.tok, "chat_template", None):
            ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers ≥5: maybe a BatchEncoding
        return list(self.tok("\n".join(m["content"] for m in msgs) + "\n", add_special_tokens=True)["input_ids"])

    def encode_sibling_prompts(self, rows: Sequence[Problem], texts: Sequence[str], rewards: Tensor,
                               group_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher prompts [N, P']: each row's chat with its last user message followed by the first correct response
        of its group other than its own (gearlab.rollout.base.sibling_demonstrations; the row keeps its plain prompt
        when there is none)."""
        demos = sibling_demonstrations(rewards, group_ids)
        out = []
        for p, d in zip(rows, demos):
            msgs = self.task.messages(p)
            if d is not None:
                msgs = [*msgs[:-1], {**msgs[-1], "content": sibling_reprompt(msgs[-1]["content"], texts[d])}]
            out.append(self._encode_chat(msgs))
        return left_pad(out, self.tok.pad_token_id)

    def _stop_ids(self) -> list[int]:
        return stop_token_ids(self.tok)

    def sample(
        self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams, seed: int | Tensor
    ) -> tuple[Tensor, Tensor]:
        """Generate for each prompt row: (response_ids [N, T] right-padded, response_mask [N, T] bool).

        A response ends at (and includes) its first stop token; everything after is padding.
        """
        resp, mask, _ = self.sample_with_logprobs(model, prompt_ids, prompt_mask, sampling, seed)
        return resp, mask

    def sample_with_logprobs(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams,
                             seed: int | Tensor, step_offset: Tensor | None = None
                             ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``sample`` plus the generating engine's log-probs of the sampled tokens [N, T] (None for HF
        ``generate``: the trainer's own forward is the reference there). ``step_offset``: see
        ``TokenGenerator.sample``."""
        if self.generator is not None:
            kw = {} if step_offset is None else {"step_offset": step_offset}
            return self.generator.sample(model, prompt_ids, prompt_mask, sampling, seed, **kw)
        return (*self._hf_sample(model, prompt_ids, prompt_mask, sampling, seed, step_offset), None)

    @torch.no_grad()
    def _hf_sample(
        self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams, seed: int | Tensor,
        step_offset: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        stop = self._stop_ids()
        outs: list[Tensor] = []
        N = prompt_ids.shape[0]
        n_calls = math.ceil(N / self.batch_size)
        if self.synced_gpus:  # ranks may hold different numbers of rows (multi-turn): all make the same calls
            n_calls = global_max_int(n_calls, device)
        seeds = row_seeds(seed, N)
        try:
            for c in range(n_calls):
                s = c * self.batch_size
                idle = s >= N  # this rank has no rows left: a one-row call whose output is dropped
                ids = (prompt_ids[s : s + self.batch_size] if not idle else idle_prompt(
                    prompt_ids, self.tok.pad_token_id
                )).to(device)
                mask = (prompt_mask[s : s + self.batch_size] if not idle else torch.ones_like(ids)).to(device)
                ids, mask = trim_left(ids, mask)
                kw: dict = {}
                if self.synced_gpus:
                    kw["synced_gpus"] = True
                if self.static_cache and not self.synced_gpus:  # (sharded policies decode eagerly)
                    ids, mask = pad_left_to(ids, mask, STATIC_PAD, self.tok.pad_token_id)
                    kw["cache_implementation"] = "static"
                if not sampling.greedy:  # (after the padding: the decode step counts from the padded width)
                    rows = seeds[s : s + self.batch_size] if not idle else seeds.new_zeros(1)
                    off = (step_offset[s : s + self.batch_size] if step_offset is not None and not idle
                           else torch.zeros_like(rows))
                    kw["logits_processor"] = [_RowSampler(rows.to(device), ids.shape[1], sampling, off.to(device))]
                # greedy selection after the row sampler's one-hot logits = the sampled token; the model's own
                # generation config (temperature, top-k/p of a pretrained checkpoint) must not act a second time
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                                     eos_token_id=stop, pad_token_id=self.tok.pad_token_id, do_sample=False,
                                     temperature=None, top_p=None, top_k=None, **kw)
                if not idle:
                    outs.append(gen[:, ids.shape[1]:].cpu())
        finally:
            model.train(was_training)
        if not outs:
            return torch.zeros((0, 1), dtype=torch.long), torch.zeros((0, 1), dtype=torch.bool)
        T = max(o.shape[1] for o in outs)
        resp = torch.cat([torch.nn.functional.pad(o, (0, T - o.shape[1]), value=self.tok.pad_token_id) for o in outs])
        is_stop = torch.isin(resp, torch.tensor(stop))
        # tokens after the first stop token are padding; the stop token itself is generated (and trained on)
        after_stop = (is_stop.long().cumsum(-1) - is_stop.long()) > 0
        mask = ~after_stop
        resp = resp.masked_fill(after_stop, self.tok.pad_token_id)
        return resp, mask

    def score(self, problems: Sequence[Problem], texts: Sequence[str]) -> Tensor:
        """Rewards [N]; a reward function that raises scores 0 (counted) unless reward_errors='raise'."""
        scored = [self.guarded_reward(lambda: self.task.reward(p, t)) for p, t in zip(problems, texts)]
        self.last_reward_errors = sum(failed for _, failed in scored)
        return torch.tensor([r for r, _ in scored], dtype=torch.float32)

    def guarded_reward(self, compute) -> tuple[float, bool]:
        """(reward, failed): ``compute()`` as a float; a raise or a non-finite value scores 0 and counts as an
        error, unless ``reward_errors='raise'``."""
        try:
            r = float(compute())
            if not math.isfinite(r):
                raise ValueError(f"non-finite reward {r}")
            return r, False
        except Exception:
            if self.reward_errors == "raise":
                raise
            return 0.0, True

    def generate(self, model: nn.Module, problems: Sequence[Problem], *, group_size: int, sampling: SamplingParams,
                 seed: int | Tensor, with_teacher: bool | str = False, group_offset: int = 0) -> RolloutBatch:
        """Sample ``group_size`` responses per problem and score them. Row i·G+j is sample j of problem i.

        with_teacher: False, or the privileged context of the teacher prompt ("answer" / "solution" / True).
        """
        prompt_ids, prompt_mask = self.encode_prompts(problems)
        rep = lambda t: t.repeat_interleave(group_size, dim=0)  # noqa: E731
        prompt_ids, prompt_mask = rep(prompt_ids), rep(prompt_mask)
        expanded = [p for p in problems for _ in range(group_size)]
        resp, rmask, engine_lp = self.sample_with_logprobs(model, prompt_ids, prompt_mask, sampling, seed)
        texts = self.tok.batch_decode(resp.masked_fill(~rmask, self.tok.pad_token_id), skip_special_tokens=True)
        rewards = self.score(expanded, texts)
        group_ids = torch.arange(len(problems)).repeat_interleave(group_size) + group_offset
        teacher = {}
        if with_teacher == "sibling":  # each row's own teacher prompt: a correct response of its group (SDPO)
            tids, tmask = self.encode_sibling_prompts(expanded, texts, rewards, group_ids)
            teacher = dict(teacher_prompt_ids=tids, teacher_prompt_mask=tmask)
        elif with_teacher:
            tids, tmask = self.encode_prompts(problems, privileged=with_teacher)
            teacher = dict(teacher_prompt_ids=rep(tids), teacher_prompt_mask=rep(tmask))
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=resp, response_mask=rmask,
            group_ids=group_ids, rewards=rewards, rollout_logprobs=engine_lp, **teacher,
            meta={"answers": [p.answer for p in expanded], "texts": list(texts),
            "reward_errors": self.last_reward_errors},
        )


class _RowSampler(LogitsProcessor):
    """A ``generate`` logits processor that draws each row's next token with its own seed
    (``gearlab.rollout.sampler.sample_rows``; the decode step is the number of tokens generated so far) and returns
    logits that are -inf everywhere else, so the greedy selection after it takes the drawn token."""

    def __init__(self, seeds: Tensor, width: int, sampling: SamplingParams, offsets: Tensor) -> None:
        self.seeds, self.width, self.sp, self.offsets = seeds, width, sampling, offsets

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        step = self.offsets + (input_ids.shape[1] - self.width)  # [B]: each row's draw number
        tok, _ = sample_rows(scores, self.seeds, step, temperature=self.sp.temperature, top_k=self.sp.top_k,
                             top_p=self.sp.top_p)
        return torch.full_like(scores, float("-inf")).scatter_(1, tok[:, None], 0.0)
