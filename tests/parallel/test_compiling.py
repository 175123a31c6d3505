"""trainer.compile: compiled decoder layers and head chunks give the eager numbers, and leave decoding,
parameters and state-dict names alone. Inductor on CPU (C++ codegen): the first compile takes seconds."""
import copy

import pytest
import torch

from gearlab.parallel.compiling import compile_decoder_layers, is_compiled
from gearlab.core.logprobs import response_hidden, token_kl, token_logprobs


def _batch(model, B=3, P=5, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    prompt = torch.randint(5, V, (B, P), generator=g)
    resp = torch.randint(5, V, (B, T), generator=g)
    pmask = torch.ones_like(prompt)
    pmask[0, :2] = 0  # a left-padded prompt
    rmask = torch.ones_like(resp)
    rmask[1, 4:] = 0  # a short response
    return torch.cat([prompt, resp], 1), torch.cat([pmask, rmask], 1), resp, P, T


def _loss_and_grads(model, ids, mask, resp, P, T, compiled, packed=False):
    model.zero_grad(set_to_none=True)
    h = response_hidden(model, ids, mask, P, T, packed=packed)
    lp, ent = token_logprobs(h, model.get_output_embeddings(), resp, temperature=0.8, chunk_size=8,
                             with_entropy=True, compiled=compiled)
    m = mask[:, P:].float()
    ((lp * m).sum() + 0.1 * (ent * m).sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed,checkpointing", [(False, False), (True, False), (False, True)])
def test_compiled_layers_and_head_match_eager_values_and_gradients(tiny_model_factory, packed, checkpointing):
    eager = tiny_model_factory(0)
    comp = copy.deepcopy(eager)
    if checkpointing:  # the recipes' setting: HF recomputes each (compiled) layer in backward
        comp.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        comp.train()  # HF checkpoints only in training mode (no dropout in these models)
    keys = list(comp.state_dict())
    assert compile_decoder_layers(comp) == eager.config.num_hidden_layers
    assert is_compiled(comp) and not is_compiled(eager)
    assert compile_decoder_layers(comp) == 0  # idempotent
    assert list(comp.state_dict()) == keys  # checkpoints, export and vLLM sync see the same names
    for seed, T in [(0, 7), (1, 9)]:  # a second shape: the recompiled (dynamic) graph is right too
        ids, mask, resp, P, T = _batch(eager, T=T, seed=seed)
        lp0, ent0, g0 = _loss_and_grads(eager, ids, mask, resp, P, T, compiled=False, packed=packed)
        lp1, ent1, g1 = _loss_and_grads(comp, ids, mask, resp, P, T, compiled=True, packed=packed)
        torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
        for n in g0:
            # atol 1e-5: the tied embedding's gradient sums every token's contribution, and the eager side's matrix
            # products (MKL's generic branch, gearlab.cpu_kernels) add in another order than inductor's kernels:
            # single elements near cancellation differ by ~2e-6 (gradients here are ~1e-2)
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_compiled_kl_matches_eager():
    torch.manual_seed(3)
    head, thead = torch.nn.Linear(16, 40), torch.nn.Linear(16, 40)
    hs, ht = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    ref = token_kl(hs, ht, head, teacher_head=thead, chunk_size=5)
    torch.testing.assert_close(token_kl(hs, ht, head, teacher_head=thead, chunk_size=5, compiled=True), ref)


def test_generation_with_a_cache_stays_eager_and_unchanged(tiny_model_factory):
    from torch._dynamo.utils import counters

    model = tiny_model_factory(0).eval()
    ids = torch.randint(5, model.config.vocab_size, (2, 6))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    want = model.generate(ids, **kw)
    compile_decoder_layers(model)
    counters.clear()
    assert torch.equal(model.generate(ids, **kw), want)
    assert counters["frames"]["total"] == 0  # every decoding call carried the KV cache: nothing was traced
    with torch.no_grad():
        model(ids, use_cache=False)  # a cache-free forward does go through the compiled layers
    assert counters["frames"]["total"] > 0


def test_training_with_compile_matches_eager(tmp_path, tiny_model_dir):
    """One real iteration through Lightning (GEAR: teacher KL signals; a KL-regularised reference copy;
    an entropy bonus, so the step moves the weights of a model that earns no reward yet):
    trainer.compile=true reaches the eager run's weights."""
    from transformers import AutoModelForCausalLM

    from gearlab.config import load_config
    from gearlab.trainer.train import train

    def run(name, *extra):
        return train(load_config([f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path / name}",
                                  "assigner=gear", "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.01",
                                  "trainer.max_steps=1", "rollout.prompts_per_step=4",
                                  "rollout.group_size=4", "rollout.max_new_tokens=10", "algorithm.micro_batch_size=8",
                                  "optim.lr=1e-3", "eval.num_problems=0", "trainer.progress_bar=false", *extra]))

    from torch._dynamo.utils import counters

    eager = run("eager")
    counters.clear()
    comp = run("compiled", "trainer.compile=true")
    assert counters["frames"]["total"] > 0  # the compiled path did run
    import mlflow

    run = mlflow.MlflowClient(comp.tracking_uri).get_run(comp.mlflow_run_id)
    assert run.data.metrics["compile/graphs_total"] > 0 and "compile/graphs_total" not in \
        mlflow.MlflowClient(eager.tracking_uri).get_run(eager.mlflow_run_id).data.metrics
    a = AutoModelForCausalLM.from_pretrained(eager.run_dir / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(comp.run_dir / "final").state_dict()
    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert max((a[k] - init[k]).abs().max() for k in a) > 1e-4  # the step moved the weights
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=k)


def test_compile_with_fsdp1_is_refused():
    from gearlab.config import ConfigError, load_config
    from gearlab.parallel.distributed import check

    cfg = load_config(
        ["trainer.compile=true", "trainer.strategy=fsdp1", "trainer.accelerator=gpu", "trainer.devices=2"]
    )
    with pytest.raises(ConfigError, match="trainer.compile.*fsdp1"):
        check(cfg)


@pytest.mark.parametrize("limit", [None, 8])
def test_every_forward_variant_of_a_run_gets_compiled(tiny_model_factory, monkeypatch, request, limit):
    """A run calls the layers with grad on/off, in train/eval mode, with and without an attention mask and at
    varying shapes: more guard variants than Dynamo's default limit of 8, past which it silently runs eager.
    The raised limit compiles them all (limit=8 shows the test can fail)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import gearlab.parallel.compiling as compiling

    torch._dynamo.reset()
    if limit is not None:
        monkeypatch.setattr(compiling, "RECOMPILE_LIMIT", limit)
        # through Dynamo's own patch (undone after the test): monkeypatch's undo would leave the entry hidden
        patch = torch._dynamo.config.patch(recompile_limit=limit)
        patch.__enter__()
        request.addfinalizer(lambda: patch.__exit__(None, None, None))
    model = tiny_model_factory(0)
    compile_decoder_layers(model)
    counters.clear()
    V = model.config.vocab_size
    for rows, length in [(3, 8), (4, 11)]:
        for grad in (True, False):
            for training in (True, False):
                for padded in (True, False):
                    ids = torch.randint(5, V, (rows, length))
                    mask = torch.ones_like(ids)
                    mask[0, :2] = 0 if padded else 1
                    model.train(training)
                    with torch.set_grad_enabled(grad):
                        response_hidden(model, ids, mask, 4, length - 4)
    graphs = counters["stats"]["unique_graphs"]
    if limit is None:
        assert graphs > 8  # every variant compiled
    else:
        assert graphs <= 8  # the default limit stops compiling: what the raised limit prevents


def test_compiled_code_is_generated_in_inductors_deterministic_mode(monkeypatch):
    """Inductor times candidate block sizes of reduction kernels on a GPU and keeps the fastest, which changes the
    summation order by process (three children on one H200 sampled different tokens from the same start and seeds).
    gearlab's compile sites generate their code in Inductor's deterministic mode — as a compile option, since Dynamo
    resets the global flag after each frame — unless TORCHINDUCTOR_DETERMINISTIC=0 asks to keep the timing."""
    import torch._inductor.config as inductor
    import torch._inductor.graph as graph

    from gearlab.parallel.compiling import deterministic_compile

    seen = []
    codegen = graph.GraphLowering.codegen

    def spy(self, *a, **k):  # the flag as Inductor's code generation reads it
        seen.append(inductor.deterministic)
        return codegen(self, *a, **k)

    monkeypatch.setattr(graph.GraphLowering, "codegen", spy)
    # A cached graph (an earlier run) skips codegen, so the caches are off here. Through Inductor's own patch, not
    # monkeypatch: pytest >= 9 finds no entry in the config module's __dict__ and undoes by deleting, which hides the
    # key for every later compilation in the process ("force_disable_caches does not exist").
    with inductor.patch(force_disable_caches=True):
        for env, want in ((None, True), ("0", False)):
            if env is None:
                monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC", raising=False)
            else:
                monkeypatch.setenv("TORCHINDUCTOR_DETERMINISTIC", env)
            torch._dynamo.reset()
            f = deterministic_compile(lambda x: torch.softmax(x * 2, -1).sum(-1))
            x = torch.randn(4, 8)
            torch.testing.assert_close(f(x), torch.softmax(x * 2, -1).sum(-1))
            assert seen and seen[-1] is want, (env, seen)
    assert inductor.deterministic is False  # the global flag is left as it was
    assert inductor.force_disable_caches is False  # and the caches' switch readable and restored
