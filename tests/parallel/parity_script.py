"""One GRPO optimizer step on a FIXED global batch under a Lightning strategy; rank 0 saves the
global loss and the full (unsharded) gradients. Run as a script (Lightning re-launches it per rank):

    python tests/parallel/parity_script.py OUT.pt DEVICES STRATEGY AGG MICRO_BATCH [ACCELERATOR [PACKED]]

tests/parallel/test_distributed.py compares 1 process with 2 (ddp, fsdp2): equal within float tolerance.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from gearlab.parallel import distributed  # noqa: E402
from gearlab.core.batch import RolloutBatch  # noqa: E402
from gearlab.config import load_config  # noqa: E402
from gearlab.credit import build  # noqa: E402
from gearlab.models.tiny import build_tiny_model, build_tokenizer  # noqa: E402
from gearlab.trainer.module import GRPOModule  # noqa: E402
from gearlab.tasks.registry import get_task  # noqa: E402

B, P, T = 8, 5, 7


def global_batch() -> tuple[RolloutBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    lens = torch.tensor([7, 3, 5, 1, 6, 7, 2, 4])
    resp_mask = torch.arange(T)[None] < lens[:, None]
    plen = torch.tensor([5, 4, 5, 3, 2, 5, 4, 5])
    prompt_mask = torch.arange(P)[None] >= (P - plen)[:, None]
    rb = RolloutBatch(prompt_ids=torch.randint(3, 300, (B, P), generator=g) * prompt_mask,
                      prompt_mask=prompt_mask.long(),
                      response_ids=torch.randint(3, 300, (B, T), generator=g) * resp_mask, response_mask=resp_mask,
                      group_ids=torch.arange(B) // 4, rewards=torch.rand(B, generator=g))
    old = -torch.rand(B, T, generator=g) * 3  # π_old ≠ π: the ratio and clipping matter
    adv = torch.randn(B, T, generator=g) * resp_mask
    return rb.with_(old_logprobs=old), adv


class ParityModule(GRPOModule):
    def training_step(self, batch, batch_idx):
        rb, adv = global_batch()
        rb = rb.with_(**{k: v.to(self.device) for k, v in vars(rb).items() if isinstance(v, torch.Tensor)})
        adv = adv.to(self.device)
        w, r = self.trainer.world_size, self.trainer.global_rank
        idx = torch.arange(r * B // w, (r + 1) * B // w)
        self.losses = []
        self._update(rb.select(idx), adv[idx], rb.response_mask[idx], it=0)

    def _micro_loss(self, mb, adv, mask, counts, **kw):
        loss, metrics = super()._micro_loss(mb, adv, mask, counts, **kw)
        self.losses.append(loss.detach())
        return loss, metrics

    def on_before_optimizer_step(self, optimizer):
        from torch.distributed.tensor import DTensor

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

        if isinstance(self.policy, FSDP1):  # FSDP1 (GPU only): gather each unit's flat gradient, split it by parameter
            grads = _fsdp1_full_grads(self.policy)
        else:
            grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().float().cpu()
                     for n, p in self.policy.named_parameters()}
        # each rank's loss carries a factor dp_size (gradients are AVERAGED over ranks): the objective is the mean
        loss = self._global_sum(torch.stack(self.losses).sum()) / self.trainer.world_size
        if self.trainer.is_global_zero:
            from torch._dynamo.utils import counters

            torch.save({"loss": loss.item(), "grads": grads, "dynamo_frames": counters["frames"]["total"]}, sys.argv[1])


def _fsdp1_full_grads(root) -> dict:
    """{parameter name: full gradient} of an FSDP1 model (use_orig_params=False): all-gather every unit's
    sharded flat gradient and cut it into the original parameters (FlatParameter's own bookkeeping)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    out = {}
    for name, unit in root.named_modules():
        if not isinstance(unit, FSDP1) or unit._handle is None:
            continue
        fp = unit._handle.flat_param
        g = fp.grad if fp.grad is not None else torch.zeros_like(fp)
        full = torch.empty(g.numel() * dist.get_world_size(), dtype=g.dtype, device=g.device)
        dist.all_gather_into_tensor(full, g.contiguous())
        prefix = name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
        prefix = prefix + "." if prefix and not prefix.endswith(".") else prefix
        offset, k = 0, 0
        for numel, is_pad in zip(fp._numels_with_padding, fp._is_padding_mask):
            if not is_pad:
                out[prefix + fp._fqns[k]] = full[offset : offset + numel].view(fp._shapes[k]).float().cpu()
                k += 1
            offset += numel
    return out


def main() -> None:
    _, devices, strategy, agg, mbs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    accel = sys.argv[6] if len(sys.argv) > 6 else "cpu"  # "gpu": NCCL on CUDA devices (fp32, so 1e-4 tolerances hold)
    packed = len(sys.argv) > 7 and sys.argv[7] == "packed"  # padding-free forwards
    cfg = load_config([f"trainer.devices={devices}", f"trainer.strategy={strategy}", f"trainer.accelerator={accel}",
                       f"algorithm.agg={agg}", f"algorithm.micro_batch_size={mbs}", "algorithm.entropy_coef=0.01",
                       "rollout.prompts_per_step=2", "rollout.group_size=4", "algorithm.clip_high=0.28",
                       f"algorithm.packed={packed}",
                       f"algorithm.micro_batch_tokens={os.environ.get('PARITY_MICRO_BATCH_TOKENS', '0')}",
                       f"trainer.compile={os.environ.get('PARITY_COMPILE', '0') == '1'}"])
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                             intermediate_size=128, seed=0)
    module = ParityModule(cfg, model, tok, get_task("arith"), build("grpo"))
    trainer = L.Trainer(accelerator=accel, devices=devices, strategy=distributed.make_strategy(cfg), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=[{"iteration": 0}])


if __name__ == "__main__":
    main()
