"""FSDP2 under bf16-mixed computes what one unsharded process computes under bf16 autocast (2 processes, gloo,
CPU autocast): the same logits and the same gradients to the bit, where one process's backward passes hold the
rows each rank holds (bf16 autocast rounds each pass's weight gradients to bfloat16, so which rows share a pass
matters: the trainer's micro-batches, gearlab.trainer.batching.tiled_mini_batches). With FSDP2's usual all-bfloat16
gathering the embedding and norms would be bfloat16 and the logits differ (checked too, so the comparison can
tell)."""
from __future__ import annotations

import copy

import torch
import torch.multiprocessing as mp

from tests.parallel.tiny import join_gloo


def _worker(rank: int, world: int, init: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import gearlab.core  # noqa: F401  (as in a run: nn.Linear's CPU route is in force)
    from gearlab.parallel.distributed import decoder_layers, leave_process_group, shard_fsdp2, unsharded

    tok, model = join_gloo(rank, world, init)
    plain, usual = copy.deepcopy(model), copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    shard_fsdp2([model], mesh, bf16=True, cpu_offload=False)
    every = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # FSDP2's usual setting
    for layer in decoder_layers(usual):
        fully_shard(layer, mesh=mesh, mp_policy=every)
    fully_shard(usual, mesh=mesh, mp_policy=every)

    ids = torch.randint(3, len(tok), (4, 9), generator=torch.Generator().manual_seed(5))
    mine = ids[2 * rank : 2 * rank + 2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(input_ids=mine).logits
        ref_rows = plain(input_ids=mine).logits
        usual_rows = usual(input_ids=mine).logits
        got.float().pow(2).mean().backward()  # FSDP2 averages the ranks' gradients
        for half in (ids[:2], ids[2:]):  # the same rows per backward as the ranks: each call's weight gradients
            (plain(input_ids=half).logits.float().pow(2).mean() / 2).backward()  # are bf16-rounded sums
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    with unsharded(model):
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"got": got.detach(), "ref": ref_rows.detach(), "usual": usual_rows.detach(), "grads": grads,
                    "ref_grads": {n: p.grad for n, p in plain.named_parameters()}, "dtypes": dtypes}, out)
    leave_process_group()


def test_fsdp2_bf16_equals_one_process_under_autocast(tmp_path):
    out = tmp_path / "r.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    r = torch.load(out)
    assert torch.equal(r["got"], r["ref"])  # the same computation, bit for bit
    assert not torch.equal(r["usual"], r["ref"])  # bfloat16 norms and embedding: another computation
    for n, g in r["grads"].items():  # the ranks' float32 halves added as one process accumulates them
        if n == "model.embed_tokens.weight":  # tied to the head: its two uses add up in another order (fp32)
            torch.testing.assert_close(g, r["ref_grads"][n], rtol=1e-6, atol=1e-9)
        else:
            assert torch.equal(g, r["ref_grads"][n]), n
    d = r["dtypes"]
    assert d["model.embed_tokens.weight"] == torch.float32 and d["model.norm.weight"] == torch.float32
    assert d["model.layers.0.input_layernorm.weight"] == torch.float32
    assert d["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert d["model.layers.1.mlp.down_proj.weight"] == torch.bfloat16
