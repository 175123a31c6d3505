"""Which CPU kernel gives other digits on another CPU class? One hash per operation of gearlab's CPU path.

Each operation runs on fixed seeded inputs (the shapes of the embedded tiny model: hidden 64, 4 heads of 16,
vocabulary 1,024, 32 rows of 48 tokens); the printed JSON maps operation -> SHA-256 of its outputs (and gradients
where it has them). Run it on two machines with the same torch, in the same environment: the keys whose hashes differ
are the kernels that depend on the CPU.

    python experiments/cpu_op_probe.py [--threads 2]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gearlab  # noqa: E402,F401  (pins the kernels unless GEARLAB_CPU_KERNELS=native)
import gearlab.core  # noqa: E402,F401  (routes nn.Linear to oneDNN when pinned)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gearlab.cpu_kernels import describe  # noqa: E402


def _h(*ts: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(t.detach().contiguous().float().numpy().tobytes())
    return h.hexdigest()[:12]


def probe() -> dict[str, str]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    out: dict[str, str] = {}
    x, w, b = r(1536, 64, grad=True), r(192, 64, grad=True), r(192, grad=True)
    y = F.linear(x, w)
    y.square().sum().backward()
    out["linear_nobias"] = _h(y, x.grad, w.grad)
    x.grad = w.grad = None
    y = F.linear(x, w, b)
    y.square().sum().backward()
    out["linear_bias"] = _h(y, x.grad, w.grad, b.grad)
    e = r(1024, 64, grad=True)
    y = F.linear(x, e)  # the tied lm head: [1536, 1024]
    y.logsumexp(-1).sum().backward()
    out["lm_head"] = _h(y, e.grad)
    out["mm_small"] = _h(r(48, 16) @ r(16, 48))
    out["bmm"] = _h(torch.bmm(r(128, 48, 16), r(128, 16, 48)))
    q, k, v = r(32, 4, 48, 16, grad=True), r(32, 4, 48, 16, grad=True), r(32, 4, 48, 16, grad=True)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.square().sum().backward()
    out["sdpa_causal"] = _h(o, q.grad, k.grad, v.grad)
    mask = torch.ones(32, 1, 48, 48, dtype=torch.bool).tril()
    mask[:4, :, :, :3] = False
    mask[:4, :, :, 0] = True
    out["sdpa_mask"] = _h(F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=mask))
    z = r(1536, 1024, grad=True)
    ls = F.log_softmax(z, -1)
    ls.sum().backward()
    out["log_softmax"] = _h(ls, z.grad)
    out["softmax"] = _h(F.softmax(z.detach(), -1))
    tgt = torch.randint(0, 1024, (1536,), generator=g)
    z.grad = None
    ce = F.cross_entropy(z, tgt)
    ce.backward()
    out["cross_entropy"] = _h(ce, z.grad)
    a = r(1536, 64, grad=True)
    rms = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)
    rms.sum().backward()
    out["rmsnorm"] = _h(rms, a.grad)
    out["silu"] = _h(F.silu(r(1536, 192)))
    out["exp"] = _h(torch.exp(r(100_000)))
    out["log"] = _h(torch.log(r(100_000).abs() + 0.1))
    out["sin_cos"] = _h(torch.sin(r(100_000) * 30), torch.cos(r(100_000) * 30))
    out["sum_big"] = _h(r(1_000_003).sum(), r(1536, 1024).sum(-1))
    out["cumsum"] = _h(torch.softmax(r(64, 1024), -1).cumsum(-1))
    out["norm"] = _h(torch.linalg.vector_norm(r(100_000)), torch._foreach_norm([r(1000), r(64, 64)])[0])
    idx = torch.randint(0, 1024, (32, 48), generator=g)
    emb = r(1024, 64, grad=True)
    F.embedding(idx, emb).square().sum().backward()
    out["embedding_bwd"] = _h(emb.grad)
    ps = [r(192, 64) for _ in range(3)]
    for p in ps:
        p.grad = r(*p.shape)
    for fused in (False, True):
        qs = [p.clone().requires_grad_() for p in ps]
        for q_, p in zip(qs, ps):
            q_.grad = p.grad.clone()
        opt = torch.optim.AdamW(qs, lr=3e-3, betas=(0.9, 0.98), weight_decay=0.01, fused=fused or None,
                                foreach=None if fused else True)
        for _ in range(3):
            opt.step()
        out["adamw_fused" if fused else "adamw_foreach"] = _h(*qs)
    # nn.Linear, which gearlab routes to oneDNN on the CPU (gearlab.cpu_kernels.route_linear): the embedded model's
    # products (update micro-batch 704 rows, decode 64 rows; q/o 192x192, k/v 64x192, MLP 512x192 and 192x512, the
    # tied head 319x192), forward and both gradients, on 1 and 2 threads
    threads = torch.get_num_threads()
    for n_thr in (1, 2):
        torch.set_num_threads(n_thr)
        for rows, n_out, n_in in ((704, 192, 192), (704, 64, 192), (704, 512, 192), (704, 192, 512), (704, 319, 192),
                                  (64, 512, 192), (64, 319, 192), (4096, 512, 192)):
            lin = torch.nn.Linear(n_in, n_out, bias=False)
            with torch.no_grad():
                lin.weight.copy_(r(n_out, n_in))
            xl = r(rows, n_in, grad=True)
            yl = lin(xl)
            yl.square().sum().backward()
            out[f"nn_linear_{rows}x{n_out}x{n_in}_t{n_thr}"] = _h(yl, xl.grad, lin.weight.grad)
    torch.set_num_threads(threads)
    probs = torch.softmax(r(16, 1024), -1)
    torch.manual_seed(3)
    out["multinomial"] = _h(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(3)).float())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(ap.parse_args().threads)
    res = probe()
    print(json.dumps({**describe(), "torch": torch.__version__, "ops": res}))


if __name__ == "__main__":
    main()
