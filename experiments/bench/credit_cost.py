"""Extra cost of each credit method over GRPO, on one batch: signals + ``assign`` time, signal peak memory.

    python experiments/bench/credit_cost.py --preset cpu          # embedded tiny model, real rollouts
    python experiments/bench/credit_cost.py --preset qwen3-0.6b   # GPU: Qwen3-0.6B shape, random bf16 weights,
                                                                  # vocab 151,936, 4,096-token responses
    python experiments/bench/credit_cost.py --preset qwen3-0.6b --layers 1 --response-len 64 --sequences 4 \
        --dtype float32                                           # the GPU preset's dry run on a CPU (~3 min)

GRPO's training-side time is measured two ways, and each method's extra time is reported against both:
  * ``grpo_offpolicy_s`` = the π_old log-prob pass (which verl always runs, and gearlab runs whenever
    ppo_epochs > 1 or mini_batches > 1) + the update (forward + backward over the batch);
  * ``grpo_onpolicy_s``  = the update alone (gearlab's strictly on-policy default skips the old-log-prob pass).
A method's cost = (its signal pass, which also yields the π_old log-probs) + assign + the same update.
With the entropy taken from the update's own forward (methods whose ``chunk_local`` allows it), the extra is
measured against GRPO's update in alternating pairs (``paired_timed``): the median of the per-pair differences
and their range, not one update timed at the start against one timed later.
Peak memory: the allocator's peak during the signal computation minus the peak of a plain no-grad
forward of one micro-batch (GPU only; "the model's forward at that size").
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gearlab import credit  # noqa: E402
from gearlab.core.batch import RolloutBatch  # noqa: E402
from gearlab.core.grpo import group_advantages, policy_loss  # noqa: E402
from gearlab.credit.methods import build_method  # noqa: E402
from gearlab.core.logprobs import response_hidden, token_logprobs  # noqa: E402
from gearlab.signals.provider import SignalProvider  # noqa: E402
from gearlab.signals.registry import signal_name  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _seconds(fn, dev) -> tuple[float, object]:
    """Wall seconds of one call of ``fn`` between device synchronisations, and its result."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t0, out


def timed(fn, dev, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t, out = _seconds(fn, dev)
        times.append(t)
    return statistics.median(times), out


def paired_timed(base, variant, dev, repeats: int) -> dict:
    """``base`` and ``variant`` timed alternately, ``repeats`` pairs after one warm-up of each, so slow drift of
    the machine (clocks, temperature, the allocator) falls on both. Returns the median of each, and the median and
    range of the per-pair relative difference (variant − base) / base."""
    base(), variant()
    a, b = [], []
    for _ in range(repeats):
        a.append(_seconds(base, dev)[0])
        b.append(_seconds(variant, dev)[0])
    rel = [(y - x) / x for x, y in zip(a, b)]
    return {"base_s": round(statistics.median(a), 4), "variant_s": round(statistics.median(b), 4),
            "extra_median": round(statistics.median(rel), 4), "extra_min": round(min(rel), 4),
            "extra_max": round(max(rel), 4), "pairs": repeats}


def update_pass(model, batch: RolloutBatch, adv, micro: int, temperature: float, chunk: int, assign=None) -> None:
    """Forward + backward of the clipped surrogate over the batch in micro-batches (gradients accumulate).
    ``assign`` (in-forward credit, as the trainer's ``signals.entropy_in_forward``): a function (micro-batch, its
    rows, entropy) → token advantages, fed by the entropy of the update's own forward; then ``adv`` is unused."""
    model.train()
    for s in range(0, batch.batch_size, micro):
        rows = torch.arange(s, min(s + micro, batch.batch_size), device=batch.response_ids.device)
        mb = batch.select(rows)
        h = response_hidden(model, mb.input_ids(), mb.full_attention_mask(), mb.prompt_ids.shape[1], mb.response_len)
        lp, ent = token_logprobs(h, model.get_output_embeddings(), mb.response_ids, temperature=temperature,
                                 chunk_size=chunk, with_entropy=assign is not None)
        a = adv[s:s + micro] if assign is None else assign(mb, rows, ent.detach().float())
        loss, _ = policy_loss(lp, lp.detach(), a, mb.response_mask,
                              global_tokens=batch.response_mask.sum().float())
        loss.backward()
    model.zero_grad(set_to_none=True)


def cpu_setup(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gearlab.rollout.hf import HFRolloutEngine
    from gearlab.rollout.base import SamplingParams
    from gearlab.tasks.registry import get_task

    d = Path(args.model_dir) if args.model_dir else ROOT / "runs" / "embedded" / "tiny-arith"
    if not d.is_dir():
        from gearlab.models.warmstart import warmstart

        warmstart(d, task="arith")
    tok = AutoTokenizer.from_pretrained(d)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(d)
    task = get_task("arith")
    problems = task.problems("test", 16, 0)
    engine = HFRolloutEngine(tok, task)
    sp = SamplingParams(max_new_tokens=48)
    rb = engine.generate(model, problems, group_size=8, sampling=sp, seed=0, with_teacher="answer")
    from gearlab.rollout.mc import resampler_of_groups

    return model, tok, rb, dict(
        micro=16,
        chunk=256,
        repeats=3,
        pairs=5,
        desc="tiny Qwen3 1.24M params, vocab 319, 128 sequences (16 prompts × 8), real rollouts ≤ 48 tokens, fp32",
        # Monte-Carlo methods (vineppo) continue these rollouts through the same engine
        resampler=lambda: resampler_of_groups(engine, model, rb, problems, 8, sp),
    )


def gpu_setup(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gearlab.models.tiny import build_tokenizer

    cfg = Qwen3Config(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                      max_position_embeddings=8192, rope_theta=1_000_000.0)
    torch.manual_seed(0)
    # cpu: a dry run of the GPU preset (--layers 1 --dtype float32: bf16 matmuls crawl on a CPU without bf16 units)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = Qwen3ForCausalLM(cfg).to(getattr(torch, args.dtype))
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    # The small offline tokenizer only decodes ids < its vocabulary, and span detection needs text, so responses
    # are its tokens of arithmetic lines (the model's vocabulary is still 151,936 for every logit). Text, not
    # random ids: random ids decode to characters split over byte tokens, which sends the segmentation down its
    # slow path, a cost real responses do not pay.
    tok = build_tokenizer()
    B, P, T = args.sequences, 256, args.response_len
    g = torch.Generator().manual_seed(0)
    small_v = len(tok)
    answer = tok("\nAnswer: 42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    lines = "".join(f"Step {k}: {k * 7} + {k + 3} = {k * 8 + 3}, so carry {k % 10}.\n" for k in range(T))
    body = tok(lines, add_special_tokens=False)["input_ids"]
    resp = torch.tensor([body[b * 7:][: T - len(answer)] + answer for b in range(B)])  # each row its own lines
    rb = RolloutBatch(prompt_ids=torch.randint(5, small_v, (B, P), generator=g), prompt_mask=torch.ones(B, P,
                      dtype=torch.long),
                      response_ids=resp, response_mask=torch.ones(B, T, dtype=torch.bool),
                      group_ids=torch.arange(B) // 4, rewards=torch.tensor([1.0, 0.0] * (B // 2)),
                      teacher_prompt_ids=torch.randint(5, small_v, (B, P + 32), generator=g),
                      teacher_prompt_mask=torch.ones(B, P + 32, dtype=torch.long))
    rb = rb.with_(**{k: v.to(dev) for k, v in vars(rb).items() if isinstance(v, torch.Tensor)})
    n = sum(p.numel() for p in model.parameters())
    dt = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    return model, tok, rb, dict(micro=1, chunk=256, repeats=2, pairs=5,
                                desc=f"Qwen3-0.6B shape ({n / 1e6:.0f}M params, vocab 151,936), random {dt} weights, "
                                     f"{B} sequences × (256 prompt + {T} response) tokens, micro-batch 1, gradient "
                                     "checkpointing")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=["cpu", "qwen3-0.6b"], default="cpu")
    ap.add_argument("--assigners", nargs="*", default=None)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--response-len", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="qwen3-0.6b preset's weights")
    ap.add_argument(
        "--model-dir", default=None, help="cpu preset: the warm-started model (default runs/embedded/tiny-arith)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model, tok, rb, p = (cpu_setup if args.preset == "cpu" else gpu_setup)(args)
    dev = rb.response_ids.device
    temperature = 1.0
    adv = group_advantages(rb.rewards, rb.group_ids)
    tadv = adv[:, None] * rb.response_mask.float()
    provider = SignalProvider(
        model, temperature=temperature, chunk_size=p["chunk"], micro_batch_size=p["micro"], tokenizer=tok
    )
    cuda = dev.type == "cuda"

    def peak_of(fn) -> float | None:
        if not cuda:
            fn()
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30

    upd_s, _ = timed(lambda: update_pass(model, rb, tadv, p["micro"], temperature, p["chunk"]), dev, p["repeats"])
    old_s, _ = timed(lambda: provider.compute(rb, frozenset(), with_logprobs=True), dev, p["repeats"])

    def fwd_only():
        with torch.no_grad():
            model.eval()
            mb = rb.select(torch.arange(0, p["micro"], device=dev))
            response_hidden(model, mb.input_ids(), mb.full_attention_mask(), mb.prompt_ids.shape[1], mb.response_len)

    fwd_peak = peak_of(fwd_only)
    rows = []
    names = args.assigners or credit.available()
    for name in names:
        a = build_method(name)  # a name, a variant or a grid point (oar_p:perturb_kv_share=false)
        if a.requires_turns:  # no signals; time assign on a synthetic multi-turn batch of the same size
            from gearlab.credit.contract import random_batch

            mt = random_batch(0, groups=rb.batch_size // 4, group_size=4, T=rb.response_len, multi_turn=True)
            mt = mt.with_(**{k: v.to(dev) for k, v in vars(mt).items() if isinstance(v, torch.Tensor)})
            a.setup(seed=0, total_steps=100, task=type("MultiTurn", (), {"multi_turn": True})())
            mt_adv = group_advantages(mt.rewards, mt.group_ids)
            asg_s, _ = timed(lambda: a.assign(mt, mt_adv, {}), dev, p["repeats"])
            rows.append({"assigner": name, "needs": [], "signal_pass_s": 0.0, "assign_s": round(asg_s, 4),
                         "extra_vs_grpo_offpolicy": round(asg_s / (old_s + upd_s), 4),
                         "extra_vs_grpo_onpolicy": round(asg_s / upd_s, 4), "signal_peak_gib_over_forward": None,
                         "note": "assign timed on a synthetic multi-turn batch of the same B×T"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        if a.extra_rollouts and "resampler" not in p:  # a synthetic batch has no task to continue it with
            print(json.dumps({"assigner": name, "skipped": "samples continuations: real rollouts only (--preset cpu)"}))
            continue
        a.setup(seed=0, total_steps=100, task=None)
        opts = {"seed": 0, **a.signal_options()}
        kw = {"resampler": p["resampler"]()} if a.extra_rollouts else {}
        sig_s, (_, sig) = timed(
            lambda: provider.compute(rb, a.needs, with_logprobs=True, options=opts, **kw), dev, p["repeats"]
        )
        asg_s, _ = timed(lambda: a.assign(rb, adv, sig), dev, p["repeats"])
        peak = peak_of(lambda: provider.compute(rb, a.needs, with_logprobs=True, options=opts, **kw))
        extra_off = sig_s + asg_s - old_s
        in_fwd = {}
        if set(a.needs) == {credit.Signal.ENTROPY} and a.chunk_local(p["micro"]):
            hook = lambda mb, r, ent: a.assign(mb, adv[r], {credit.Signal.ENTROPY: ent}).token_advantages  # noqa: E731
            pair = paired_timed(lambda: update_pass(model, rb, tadv, p["micro"], temperature, p["chunk"]),
                                lambda: update_pass(model, rb, tadv, p["micro"], temperature, p["chunk"], assign=hook),
                                dev, p["pairs"])
            in_fwd = {"entropy_in_forward_update_s": pair["variant_s"], "grpo_update_paired_s": pair["base_s"],
                      "extra_vs_grpo_onpolicy_in_forward": pair["extra_median"],
                      "extra_in_forward_range": [pair["extra_min"], pair["extra_max"]], "pairs": pair["pairs"]}
        rows.append({
            "assigner": name, "needs": sorted(signal_name(s) for s in a.needs),
            "signal_pass_s": round(sig_s, 4), "assign_s": round(asg_s, 4),
            "extra_vs_grpo_offpolicy": round(extra_off / (old_s + upd_s), 4),
            "extra_vs_grpo_onpolicy": round((sig_s + asg_s) / upd_s, 4) if a.needs else round(asg_s / upd_s, 4),
            "signal_peak_gib_over_forward": None if peak is None else round(peak - fwd_peak, 3), **in_fwd,
        })
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "preset": args.preset, "workload": p["desc"],
        "device": torch.cuda.get_device_name() if cuda else (
            f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
        ),
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "grpo_update_s": round(upd_s, 4), "grpo_oldlogprob_pass_s": round(old_s, 4),
        "forward_peak_gib": None if fwd_peak is None else round(fwd_peak, 3), "rows": rows,
    }
    out = Path(args.out or ROOT / "experiments" / "bench" / "results" / f"credit_cost_{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    print("\n| assigner | signals | extra vs GRPO (π_old pass + update) | extra vs on-policy GRPO (update only) | "
          "same, entropy from the update's forward | signal peak over fwd (GiB) |\n|---|---|---|---|---|---|")
    for r in rows:
        fwd = "–"
        if "extra_vs_grpo_onpolicy_in_forward" in r:
            lo, hi = r["extra_in_forward_range"]
            fwd = f"{r['extra_vs_grpo_onpolicy_in_forward']:+.1%} (pairs {lo:+.1%} … {hi:+.1%})"
        print(f"| {r['assigner']} | {', '.join(r['needs']) or '–'} | {r['extra_vs_grpo_offpolicy']:+.1%} | "
              f"{r['extra_vs_grpo_onpolicy']:+.1%} | {fwd} | {r['signal_peak_gib_over_forward']} |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
