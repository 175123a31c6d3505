"""The fast decode path (rollout.engine=fast) is the same sampler: greedy tokens equal HF ``generate``'s, the
log-probs of sampled tokens equal the trainer's, a row's samples depend on its seed alone (not on the batch),
responses end at their first stop token as HF's do, and a real training run and a multi-turn rollout go
through it. (The CUDA-graph capture and its speed are exercised by experiments/bench/trl_vs_gearlab.py on a GPU.)"""
from __future__ import annotations

import pytest
import torch

from gearlab.core.logprobs import response_hidden, token_logprobs
from gearlab.rollout.base import SamplingParams
from gearlab.rollout.fast import FastDecoder
from gearlab.rollout.hf import HFRolloutEngine
from gearlab.tasks.registry import get_task


@pytest.fixture(scope="module")
def setup(tokenizer, tiny_model_factory):
    model = tiny_model_factory(0).eval()
    task = get_task("arith")
    eng = HFRolloutEngine(tokenizer, task, batch_size=8)
    ids, mask = eng.encode_prompts(task.problems("train", 7, seed=2))
    return model, eng, ids, mask


def _trainer_logprobs(model, ids, mask, resp, rmask, temperature):
    x = torch.cat([ids, resp], 1)
    am = torch.cat([mask.bool(), rmask], 1).long()
    with torch.no_grad():
        h = response_hidden(model, x, am, ids.shape[1], resp.shape[1])
        return token_logprobs(h, model.get_output_embeddings(), resp, temperature=temperature)[0]


@pytest.mark.parametrize("batch_size", [3, 8])
def test_greedy_tokens_equal_hf_generate(setup, tokenizer, batch_size):
    model, eng, ids, mask = setup
    sp = SamplingParams(max_new_tokens=24, greedy=True)
    ref, ref_mask = eng.sample(model, ids, mask, sp, seed=0)
    for shapes in ("off", "on"):  # exact lengths, and the CUDA-graph path's padded prompts and 8-token buckets
        for fused in (False, True):  # separate projections, and q/k/v and gate/up as one GEMM each
            fast = FastDecoder(tokenizer, batch_size=batch_size, bucket=8, cuda_graphs=shapes, fused=fused)
            resp, rmask, lp = fast.sample(model, ids, mask, sp, seed=0)
            assert torch.equal(rmask, ref_mask) and torch.equal(resp, ref)


def test_responses_end_at_the_first_stop_token_as_hf(setup, tokenizer):
    """Tokens the random model emits are made stop tokens: greedy responses equal HF's (layout included), and
    sampled rows stop, at different steps, exactly where their unstopped twins first drew a stop token."""
    model, eng, ids, mask = setup
    out, _ = eng.sample(model, ids, mask, SamplingParams(max_new_tokens=24, greedy=True), seed=0)
    firsts = lambda t: {row.index(t) if t in row else -1 for row in out.tolist()}  # noqa: E731
    stop = max(set(out.flatten().tolist()), key=lambda t: len(firsts(t)))  # (greedy rows of a random model repeat)
    stops = sorted(set(eng._stop_ids()) | {stop})
    eng_stop = HFRolloutEngine(tokenizer, eng.task, batch_size=8)
    eng_stop._stop_ids = lambda: stops
    fast = FastDecoder(tokenizer, batch_size=4, bucket=8, check_every=2, cuda_graphs="on")
    fast.stop_ids = stops
    sp = SamplingParams(max_new_tokens=24, greedy=True)
    ref, ref_mask = eng_stop.sample(model, ids, mask, sp, seed=0)
    resp, rmask, lp = fast.sample(model, ids, mask, sp, seed=0)
    assert rmask.sum(1).min() < 24  # (a random model's greedy rows repeat one token: they may all stop at once)
    assert torch.equal(rmask, ref_mask) and torch.equal(resp, ref)

    sp = SamplingParams(max_new_tokens=24)
    free, _, free_lp = FastDecoder(tokenizer, batch_size=4).sample(model, ids, mask, sp, seed=7)
    cut = {int(free[i, k]) for i, k in ((0, 3), (2, 9), (4, 15))}  # tokens drawn mid-response by some rows
    fast.stop_ids = sorted(set(eng._stop_ids()) | cut)
    resp, rmask, lp = fast.sample(model, ids, mask, sp, seed=7)
    lengths = rmask.sum(1)
    for i in range(len(ids)):
        hits = [k for k, t in enumerate(free[i].tolist()) if t in fast.stop_ids]
        n = hits[0] + 1 if hits else 24
        assert lengths[i] == n and torch.equal(resp[i, :n], free[i, :n]) and torch.allclose(
            lp[i, :n], free_lp[i, :n], atol=1e-5
        )
    assert len(set(lengths.tolist())) > 1 and resp.shape[1] == lengths.max()  # as wide as the longest, as HF's
    assert (lp[~rmask] == 0).all() and (resp[~rmask] == tokenizer.pad_token_id).all()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9)])
def test_sampled_logprobs_equal_the_trainers(setup, tokenizer, temperature, top_p):
    model, _, ids, mask = setup
    sp = SamplingParams(max_new_tokens=20, temperature=temperature, top_p=top_p)
    resp, rmask, lp = FastDecoder(
        tokenizer, batch_size=4, bucket=8, cuda_graphs="on"
    ).sample(model, ids, mask, sp, seed=11)
    ref = _trainer_logprobs(model, ids, mask, resp, rmask, temperature)
    assert (lp - ref)[rmask].abs().max() < 1e-5


def test_fused_projections_sample_the_trainers_logprobs_after_every_optimizer_step(tokenizer, tiny_model_factory):
    """One fused FastDecoder over a policy whose weights change in place between calls (as optimizer steps do):
    each call samples with the current weights (its log-probs are the trainer's), and the fused copies are the same
    buffers throughout."""
    model = tiny_model_factory(3).eval()
    task = get_task("arith")
    ids, mask = HFRolloutEngine(tokenizer, task, batch_size=8).encode_prompts(task.problems("train", 6, seed=4))
    fast = FastDecoder(tokenizer, batch_size=4, bucket=8, cuda_graphs="on", fused=True)
    sp = SamplingParams(max_new_tokens=16, temperature=0.8)
    buffers = None
    for step in range(3):
        resp, rmask, lp = fast.sample(model, ids, mask, sp, seed=step)
        ref = _trainer_logprobs(model, ids, mask, resp, rmask, 0.8)
        assert (lp - ref)[rmask].abs().max() < 1e-5, step
        fw = fast._decoder.fw
        buffers = buffers or [t.data_ptr() for t in fw.qkv + fw.gate_up]
        assert [t.data_ptr() for t in fw.qkv + fw.gate_up] == buffers
        assert fast.stats()["fast/fused_gib"] > 0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize("shapes,compiled", [("off", None), ("on", None), ("off", True)])
def test_flex_attention_rollout_gives_the_sdpa_tokens_and_logprobs(setup, tokenizer, shapes, compiled):
    """rollout.fast.attention=flex: a whole greedy rollout with flex_attention at every decode step gives the tokens
    of the SDPA rollout and log-probs within 1e-5 (fp32), at exact lengths and at the CUDA-graph path's padded
    prompts and 8-token buckets, 3 rows per batch (the last chunk of 7 prompts has another batch size). On the CPU
    flex_attention runs eagerly by default; once compiled (Inductor's C++ template at AVX-512, as in
    test_decoder.py; skipped without it), one graph per batch size serves every length."""
    from torch._dynamo.utils import counters

    from tests.rollout.test_decoder import _avx512, _inductor_at_avx512

    if compiled and not _avx512():
        pytest.skip("compiled flex_attention on the CPU needs AVX-512 (torch 2.13's C++ template fails at AVX2)")
    model, _, ids, mask = setup
    sp = SamplingParams(max_new_tokens=16, greedy=True)
    ref = FastDecoder(tokenizer, batch_size=3, bucket=8, cuda_graphs=shapes).sample(model, ids, mask, sp, seed=0)
    flex = FastDecoder(tokenizer, batch_size=3, bucket=8, cuda_graphs=shapes, attention="flex")
    flex._decoder_for(model).flex.compiled = compiled
    torch._dynamo.reset()
    counters.clear()
    with _inductor_at_avx512(bool(compiled)):
        out = flex.sample(model, ids, mask, sp, seed=0)
    assert flex._decoder.attention == "flex"
    if compiled:  # one graph for batches of 3 and one for the last row: none for the other lengths
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert (out[2] - ref[2])[ref[1]].abs().max() < 1e-5


def test_a_rows_samples_depend_on_its_seed_alone(setup, tokenizer):
    """Row i of a call draws with seed + i: the same row, alone or in another batch, with any decode batch size
    or bucket, gets the same tokens; another seed gives other tokens."""
    model, _, ids, mask = setup
    sp = SamplingParams(max_new_tokens=20)
    full, fmask, flp = FastDecoder(
        tokenizer, batch_size=8, bucket=8, cuda_graphs="on"
    ).sample(model, ids, mask, sp, seed=100)
    again = FastDecoder(tokenizer, batch_size=2).sample(model, ids, mask, sp, seed=100)
    assert torch.equal(full, again[0]) and torch.allclose(flp, again[2], atol=1e-6)
    part, pmask, _ = FastDecoder(tokenizer, batch_size=8).sample(model, ids[3:5], mask[3:5], sp, seed=103)
    n = pmask.shape[1]
    assert torch.equal(part, full[3:5, :n]) and torch.equal(pmask, fmask[3:5, :n])
    other = FastDecoder(tokenizer).sample(model, ids, mask, sp, seed=101)[0]
    assert not torch.equal(other, full)


@pytest.mark.parametrize("shapes", ["off", "on"])
def test_a_chunk_decodes_with_the_shapes_of_its_own_rows(tokenizer, tiny_model_factory, shapes):
    """Rows 0-3 decoded as the first chunk of a wider rank batch (their prompts padded to all 12) give bit-identical
    log-probs to rows 0-3 as a rank's whole batch (padded to their own longest): each call trims the columns that
    are padding in all its rows. On GPUs, kernels are picked by shape, so this is what lets N ranks reproduce 1."""
    model = tiny_model_factory(0).eval()
    task = get_task("arith")
    eng = HFRolloutEngine(tokenizer, task, batch_size=4)
    own, omask = eng.encode_prompts(task.problems("train", 4, seed=5))
    # rows 0-3 as a wider batch holds them: 5 more padding columns, for a longer prompt among rows 4-11
    wide = torch.nn.functional.pad(own, (5, 0), value=tokenizer.pad_token_id).repeat(3, 1)
    wmask = torch.nn.functional.pad(omask, (5, 0), value=0).repeat(3, 1)
    wide[4:, :5], wmask[4:, :5] = 7, 1
    sp = SamplingParams(max_new_tokens=12)
    fast = FastDecoder(tokenizer, batch_size=4, bucket=8, cuda_graphs=shapes)
    a, am, alp = fast.sample(model, wide, wmask, sp, seed=7)
    b, bm, blp = fast.sample(model, own, omask, sp, seed=7)
    n = bm.shape[1]
    assert torch.equal(a[:4, :n], b) and torch.equal(alp[:4, :n], blp)
    hf_wide, hf_own = eng.sample(model, wide, wmask, sp, seed=7)[0], eng.sample(model, own, omask, sp, seed=7)[0]
    assert torch.equal(hf_wide[:4, :n], hf_own)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_hf_generate_samples_the_fast_decoders_tokens(setup, tokenizer, temperature, top_p):
    """HF ``generate`` draws with the same per-row seeded sampler (a logits processor): the same sampled tokens as the
    fast decoder, and a row's tokens do not depend on its batch (the basis of N ranks = 1 rank)."""
    model, eng, ids, mask = setup
    sp = SamplingParams(max_new_tokens=20, temperature=temperature, top_p=top_p)
    hf, hf_mask = eng.sample(model, ids, mask, sp, seed=100)
    fast, fast_mask, _ = FastDecoder(tokenizer, batch_size=8).sample(model, ids, mask, sp, seed=100)
    n = hf_mask.shape[1]
    assert torch.equal(hf_mask, fast_mask[:, :n]) and torch.equal(hf, fast[:, :n])
    part, part_mask = eng.sample(model, ids[3:5], mask[3:5], sp, seed=103)  # rows 3-4 alone, seeds 103-104
    m = part_mask.shape[1]
    assert torch.equal(part, hf[3:5, :m]) and not part_mask[:, m:].any() and not hf_mask[3:5, m:].any()
    per_row = eng.sample(model, ids, mask, sp, seed=torch.arange(100, 107))[0]  # explicit per-row seeds
    assert torch.equal(per_row, hf)


def test_a_repeated_prompt_is_prefilled_once_and_samples_as_if_alone(setup, tokenizer):
    """A GRPO group (G copies of a prompt) or K Monte-Carlo continuations of one prefix: each distinct row is
    prefilled once and its cache copied to its repeats; every row samples the tokens and log-probs it draws alone."""
    model, _, ids, mask = setup
    rep = torch.tensor([0, 0, 0, 1, 1, 2, 0, 3])
    sp = SamplingParams(max_new_tokens=16)
    seeds = torch.arange(len(rep)) + 40
    fast = FastDecoder(tokenizer, batch_size=8, bucket=8, cuda_graphs="off")
    resp, rmask, lp = fast.sample(model, ids[rep], mask[rep], sp, seed=seeds)
    st = fast.stats()
    assert (st["fast/prefill_rows"], st["fast/prefill_distinct"]) == (8.0, 4.0)
    for i, r in enumerate(rep.tolist()):  # the same row and seed, decoded alone (nothing shared)
        alone, amask, alp = fast.sample(model, ids[r : r + 1], mask[r : r + 1], sp, seed=seeds[i : i + 1])
        n = int(amask.sum())
        assert int(rmask[i].sum()) == n and torch.equal(resp[i, :n], alone[0, :n])
        assert torch.allclose(lp[i, :n], alp[0, :n], atol=1e-5)


def test_top_k_one_is_greedy(setup, tokenizer):
    model, _, ids, mask = setup
    fast = FastDecoder(tokenizer, batch_size=8)
    g = fast.sample(model, ids, mask, SamplingParams(max_new_tokens=16, greedy=True), seed=0)[0]
    k1 = fast.sample(model, ids, mask, SamplingParams(max_new_tokens=16, top_k=1), seed=5)[0]
    assert torch.equal(g, k1)


def test_multi_turn_rollout_through_the_fast_path(tokenizer, tiny_model_factory):
    from gearlab.rollout.factory import make_engine

    task = get_task("tool_arith")
    problems = task.problems("train", 3, seed=0)
    model = tiny_model_factory(0).eval()
    sp = SamplingParams(max_new_tokens=12, greedy=True)
    ref = make_engine(tokenizer, task, max_turns=3).generate(model, problems, group_size=2, sampling=sp, seed=0)
    fast = make_engine(tokenizer, task, max_turns=3, generator=FastDecoder(tokenizer, bucket=8))
    rb = fast.generate(model, problems, group_size=2, sampling=sp, seed=0)
    assert torch.equal(rb.response_ids, ref.response_ids) and torch.equal(rb.response_mask, ref.response_mask)
    assert torch.equal(rb.turn_ids, ref.turn_ids)
    lp = _trainer_logprobs(model, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.attention_mask, 1.0)
    assert (lp - rb.rollout_logprobs)[rb.response_mask].abs().max() < 1e-5  # with tool text in the context


def test_gearlab_train_with_the_fast_path(tmp_path, tiny_model_dir):
    import mlflow

    from gearlab.config import load_config
    from gearlab.trainer.train import train

    cfg = load_config(["rollout.engine=fast", f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                       "trainer.max_steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
                       "rollout.max_new_tokens=16", "trainer.progress_bar=false", "eval.num_problems=4",
                       "algorithm.engine_is=token_truncate"])
    res = train(cfg)
    m = mlflow.MlflowClient(res.tracking_uri).get_run(res.mlflow_run_id).data.metrics
    assert m["fast/steps"] > 0 and m["fast/decode_s"] > 0
    # the engine decodes the trainer's current weights (after the first optimizer step too)
    assert m["update/engine_lp_diff_abs"] < 1e-5 and m["update/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["train/iteration"] == 2 and "eval/greedy_accuracy" in m


def test_config_keys():
    from gearlab.config import ConfigError, load_config

    assert load_config(["rollout.engine=fast", "algorithm.engine_is=icepop"]).rollout.fast.bucket == 64
    assert load_config(["rollout.fast.fused_projections=true"]).rollout.fast.fused_projections is True
    assert load_config([]).rollout.fast.attention == "auto"  # resolved per machine (test_factory.py)
    assert load_config(["rollout.fast.attention=flex"]).rollout.fast.attention == "flex"
    for bad in (["rollout.engine=fast", "rollout.fast.bucket=0"], ["rollout.fast.cuda_graphs=maybe"],
                ["rollout.engine=fastest"], ["rollout.fast.attention=foo"]):
        with pytest.raises(ConfigError):
            load_config(bad)


def test_a_bad_attention_value_exits_2_with_one_line(capsys):
    from gearlab.cli import main

    assert main(["train", "rollout.fast.attention=foo", "--print-config"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip().splitlines() == [
        "gearlab: error: key 'rollout.fast.attention': 'foo' is not one of auto, sdpa, sdpa_auto, flex, split"]


def test_fsdp2_two_processes_decode_the_gathered_weights_or_their_replica(tmp_path, tiny_model_dir):
    """`gearlab train rollout.engine=fast` on 2 FSDP2 processes (gloo): each rank decodes the full weights, gathered
    once per rollout or copied into a persistent replica after each optimizer step (rollout.fast.sharded_weights);
    its log-probs match the sharded trainer's forward, evaluation included, and both ways give the same run."""
    import subprocess
    import sys

    import mlflow

    histories = {}
    for mode in ("gather", "replica"):
        out = tmp_path / mode
        args = [f"model.name_or_path={tiny_model_dir}", "trainer.accelerator=cpu", "trainer.devices=2",
                "rollout.engine=fast", f"rollout.fast.sharded_weights={mode}",
                "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8", "eval.num_problems=4",
                "trainer.progress_bar=false", "optim.lr=1e-3", "trainer.max_steps=2", f"trainer.output_dir={out}"]
        r = subprocess.run(
            [sys.executable, "-m", "gearlab.cli", "train", *args], capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, r.stderr[-3000:]
        client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
        run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
        m = run.data.metrics
        assert m["fast/steps"] > 0 and m["update/engine_lp_diff_abs"] < 1e-5 and "eval/greedy_accuracy" in m
        histories[mode] = [(h.step, h.value) for k in ("train/reward", "train/response_len", "update/grad_norm")
                           for h in client.get_metric_history(run.info.run_id, k)]
        if mode == "replica":
            assert m["fast/replica_gib"] > 0 and m["fast/replica_refresh_s"] > 0
    assert len(histories["gather"]) == 6 and histories["replica"] == histories["gather"]


def test_compiled_step_samples_the_same_tokens(setup, tokenizer):
    """rollout.fast.compile=true compiles each layer's pieces around attention: the same tokens and log-probs as the
    eager step, and two graphs in all — shared by every layer and every cache length (a whole-step compile needed
    one per bucket length, each taking minutes at the 0.6B shape) — and two more for any number of other batch
    sizes."""
    from torch._dynamo.utils import counters

    model, _, ids, mask = setup
    sp = SamplingParams(max_new_tokens=12)
    eager = FastDecoder(tokenizer, batch_size=8, bucket=8).sample(model, ids, mask, sp, seed=4)
    torch._dynamo.reset()
    counters.clear()
    fd = FastDecoder(tokenizer, batch_size=8, bucket=8, compile=True)
    compiled = fd.sample(model, ids, mask, sp, seed=4)
    assert torch.equal(eager[0], compiled[0]) and torch.allclose(eager[2], compiled[2], atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    # other batch sizes (multi-turn turns, evaluation): one batch-dynamic recompile of each piece, then none
    for n in (3, 5, 2):
        ref = FastDecoder(tokenizer, batch_size=8, bucket=8).sample(model, ids[:n], mask[:n], sp, seed=4)
        out = fd.sample(model, ids[:n], mask[:n], sp, seed=4)
        assert torch.equal(ref[0], out[0]) and torch.allclose(ref[2], out[2], atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])


def test_step_buffers_follow_the_shape_and_freed_graphs_release_their_pool(setup, tokenizer):
    """A new batch shape (evaluation after training) frees the last shape's captured graphs; new captures must not
    go into their freed memory pool (on CUDA the caching allocator asserts). The buffers are keyed by device too:
    a policy that Lightning's teardown moved to the CPU and back gets buffers where it lives."""
    model = setup[0]
    fd = FastDecoder(tokenizer, batch_size=8, cuda_graphs="on")
    dec = fd._decoder_for(model)
    run = fd._run_for(dec, 8, 16, 4)
    (key,) = fd._runs
    assert key == (8, 16, 4, dec.head.weight.device)
    fd._pool = pool = object()  # stands for the CUDA graph pool of the captured steps
    assert fd._run_for(dec, *key[:3]) is run and fd._pool is pool  # same shape: same buffers, same pool
    fd._run_for(dec, key[0] + 1, *key[1:3])
    assert list(fd._runs) == [(key[0] + 1, *key[1:3], key[3])] and fd._pool is None
