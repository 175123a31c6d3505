"""The decode replica of an FSDP2 policy (2 processes, gloo): it holds the full current weights, keeps its tensors'
addresses from one refresh to the next (captured CUDA graphs stay valid), and the fast decoder sampling through it
draws the tokens that decoding the unsharded model draws."""
from __future__ import annotations

import copy

import torch
import torch.multiprocessing as mp

from gearlab.rollout.base import SamplingParams
from tests.parallel.tiny import join_gloo, small_model


def _worker(rank: int, world: int, init: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from gearlab.parallel.distributed import leave_process_group, shard_fsdp2
    from gearlab.parallel.replica import DecodeReplica
    from gearlab.rollout.fast import FastDecoder

    tok, model = join_gloo(rank, world, init)
    plain = copy.deepcopy(model)
    shard_fsdp2([model], init_device_mesh("cpu", (world,)), bf16=False, cpu_offload=False)
    rep = DecodeReplica()
    first = {n: t.clone() for n, t in rep.refresh(model).state_dict().items()}
    ptrs = [t.data_ptr() for t in rep.module.parameters()]
    # an optimizer step on the shards: the replica must follow it in place
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(3, len(tok), (2, 9), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    opt.step()
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    second = {n: t.clone() for n, t in rep.refresh(model).state_dict().items()}
    same_ptrs = ptrs == [t.data_ptr() for t in rep.module.parameters()]
    # sampling through the replica ≡ sampling the unsharded model with the same weights
    plain.load_state_dict(full, strict=False)  # (the tied head is the embedding)
    prompts = torch.randint(3, len(tok), (4, 6), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(prompts)
    sp = SamplingParams(max_new_tokens=8, temperature=1.0)
    dec = FastDecoder(tok, sharded_weights="replica")
    got = dec.sample(model, prompts, mask, sp, seed=11)
    ref = FastDecoder(tok).sample(plain, prompts, mask, sp, seed=11)
    if rank == 0:
        torch.save({"first": first, "second": second, "full": full, "plain0": plain_state(rank, tok),
                    "same_ptrs": same_ptrs, "got": got, "ref": ref, "stats": dec.stats(),
                    "tied": rep.module.lm_head.weight is rep.module.model.embed_tokens.weight}, out)
    leave_process_group()


def plain_state(rank: int, tok) -> dict:
    return small_model(tok).state_dict()


def test_the_replica_follows_the_shards_in_place_and_decodes_their_tokens(tmp_path):
    out = tmp_path / "replica.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    r = torch.load(out)
    start = r["plain0"]
    assert r["first"].keys() >= {k for k in start if not k.endswith("inv_freq")}
    for k, v in start.items():  # the first refresh: the initial weights, exactly
        assert torch.equal(r["first"][k], v), k
    moved = 0
    for k, v in r["full"].items():  # the second: the weights after the step, exactly
        assert torch.equal(r["second"][k], v), k
        moved += int(not torch.equal(v, start[k]))
    assert moved > 0 and r["same_ptrs"] and r["tied"]
    for a, b in zip(r["got"], r["ref"]):
        assert torch.equal(a, b)
    assert r["got"][1].sum() > 0 and r["stats"]["fast/replica_gib"] > 0
