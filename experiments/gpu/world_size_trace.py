"""Where do a 1-GPU and a 2-GPU run part? `gearlab train` with a trace: each iteration's sampled tokens (per global
row) and the full weights before the first and after every optimizer step are saved under $TRACE_DIR.

    TRACE_DIR=/tmp/t/a1 python experiments/gpu/world_size_trace.py train <gearlab overrides...>
    python experiments/gpu/world_size_trace.py compare /tmp/t/a1 /tmp/t/a2      # prints one JSON line

With TRACE_DETERMINISTIC=1 every CUDA kernel that has a deterministic variant uses it
(``torch.use_deterministic_algorithms(True, warn_only=True)``, cuBLAS's fixed workspace) and attention runs on
SDPA's math backend, as ``gearlab warmstart`` does on CUDA: the control that tells GPU run-to-run nondeterminism
(atomic adds in the embedding and gather backwards, the fused attention backwards) from a world-size effect.
Lightning starts the other ranks by re-running this script, so every rank is traced.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


def _install_trace(out: Path) -> None:
    from gearlab.trainer import module as M

    step = M.GRPOModule.training_step

    def full_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
                for n, p in policy.named_parameters()}

    def traced(self, batch, batch_idx):
        rank, it = self.trainer.global_rank, batch["iteration"]
        if not getattr(self, "_trace_on", False):
            generate = self.engine.generate

            def keep(*a, **k):
                self._trace_rb = generate(*a, **k)
                self._trace_seed = k.get("seed")
                return self._trace_rb

            self.engine.generate, self._trace_on = keep, True
            w = full_weights(self.policy)
            if rank == 0:
                torch.save(w, out / "w_start.pt")
        result = step(self, batch, batch_idx)
        rb = self._trace_rb
        torch.save({"seed": self._trace_seed, "response_ids": rb.response_ids.cpu(),
                    "response_mask": rb.response_mask.cpu(), "rewards": rb.rewards.cpu(),
                    "old_logprobs": None if rb.old_logprobs is None else rb.old_logprobs.float().cpu()},
                   out / f"rows_it{it}_rank{rank}.pt")
        w = full_weights(self.policy)
        if rank == 0:
            torch.save(w, out / f"w_it{it}.pt")
        return result

    M.GRPOModule.training_step = traced
    if os.environ.get("TRACE_GRADS") == "1":
        _trace_grads(out)


def _trace_grads(out: Path) -> None:
    """Save the full gradient before every optimizer step (a collective under FSDP2: every rank gathers)."""
    import torch.distributed as dist

    n = [0]

    def hook(opt, args, kwargs):
        g = {}
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None:
                    t = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    g[f"{gi}.{pi}"] = t.detach().float().cpu()
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(g, out / f"g_step{n[0]}.pt")
        n[0] += 1

    register_optimizer_step_pre_hook(hook)


def _deterministic() -> contextlib.AbstractContextManager:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gearlab.trainer import module as M

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    M.differentiable_attention = lambda: sdpa_kernel(SDPBackend.MATH)  # the update's attention
    return sdpa_kernel(SDPBackend.MATH)  # every other pass


def _rows(d: Path, it: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The sampled responses of iteration `it`, one (ids, mask) per global row, ranks in order."""
    out = []
    for f in sorted(d.glob(f"rows_it{it}_rank*.pt"), key=lambda p: int(p.stem.rsplit("rank", 1)[1])):
        r = torch.load(f)
        for ids, m in zip(r["response_ids"], r["response_mask"]):
            out.append((ids[m.bool()], m))
    return out


def _flat_diff(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor], keys=None) -> torch.Tensor:
    """x − y over every tensor (in the order of ``keys``, default x's), flattened into one vector."""
    return torch.cat([(x[k] - y[k]).flatten() for k in (keys if keys is not None else x)])


def compare(a: Path, b: Path) -> dict:
    """Per iteration: how many global rows sampled other tokens and where the first differing token is; the
    weight gap ‖w_b − w_a‖ / ‖w_a − w_start‖ (and max |·| ratio), and the fraction of weights whose update has
    the opposite sign (Adam's first step is ≈ lr·sign(g): a rounding-level gradient near 0 flips it)."""
    res: dict = {}
    w0 = torch.load(a / "w_start.pt")
    its = sorted(int(p.stem[4:]) for p in a.glob("w_it*.pt"))
    prev_a = prev_b = w0
    for it in its:
        ra, rb = _rows(a, it), _rows(b, it)
        diff = [i for i, ((x, _), (y, _)) in enumerate(zip(ra, rb)) if not torch.equal(x, y)]
        first = None
        if diff:
            x, y = ra[diff[0]][0], rb[diff[0]][0]
            n = min(len(x), len(y))
            neq = (x[:n] != y[:n]).nonzero()
            first = int(neq[0]) if len(neq) else n
        wa, wb = torch.load(a / f"w_it{it}.pt"), torch.load(b / f"w_it{it}.pt")
        up, gap = _flat_diff(wa, w0), _flat_diff(wb, wa)
        flips = ((_flat_diff(wa, prev_a) * _flat_diff(wb, prev_b, keys=wa)) < 0).float().mean()
        res[f"it{it}"] = {"rows": len(ra), "rows_other_tokens": len(diff), "first_row": diff[0] if diff else None,
                          "first_token_pos": first, "norm_ratio": float(gap.norm() / up.norm()),
                          "max_ratio": float(gap.abs().max() / up.abs().max()),
                          "step_sign_flips": float(flips)}
        prev_a, prev_b = wa, wb
    for f in sorted(a.glob("g_step*.pt")):
        ga, gb = torch.load(f), torch.load(b / f.name)
        da, db = torch.cat([ga[k].flatten() for k in ga]), torch.cat([gb[k].flatten() for k in ga])
        d = (db - da).abs()
        rel = d / da.abs().clamp_min(1e-30)
        res[f.stem] = {"g_absmax": float(da.abs().max()), "g_median_abs": float(da.abs().median()),
                       "diff_absmax": float(d.max()), "diff_rel_norm": float(d.norm() / da.norm()),
                       "frac_rel_gt_1e-3": float((rel > 1e-3).float().mean()),
                       "frac_abs_lt_1e-8": float((da.abs() < 1e-8).float().mean()),
                       "frac_sign_differs": float(((da * db) < 0).float().mean()),
                       "worst": [[k, float((gb[k] - ga[k]).abs().max()), float(ga[k].abs().max())]
                                 for k in sorted(ga, key=lambda k: -float(((gb[k] - ga[k]).norm()
                                                                          / ga[k].norm().clamp_min(1e-30))))[:4]]}
    return res


def main() -> int:
    if sys.argv[1] == "compare":
        print(json.dumps(compare(Path(sys.argv[2]), Path(sys.argv[3]))))
        return 0
    out = Path(os.environ["TRACE_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    _install_trace(out)
    ctx = _deterministic() if os.environ.get("TRACE_DETERMINISTIC") == "1" else contextlib.nullcontext()
    from gearlab.cli import main as cli

    with ctx:
        return cli(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
