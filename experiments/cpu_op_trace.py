"""Where does a long run first differ between two CPU classes? A hash of every operation's output, in order.

Runs one child of the main job (``experiment=embedded``, default ``assigner=grpo trainer.seed=0``) in this process
under a TorchDispatchMode that writes, for every ATen operation, ``index op shapes hash`` (the blake2b of each output
tensor's bytes) to a gzip file, and the weights digest after every iteration to a second file. Run it on two machines
with the same versions; ``--compare A B`` prints the first operation whose output differs, with its neighbours.

    python experiments/cpu_op_trace.py OUT_DIR [overrides...]
    python experiments/cpu_op_trace.py --compare A/ops.txt.gz B/ops.txt.gz
"""
from __future__ import annotations

import gzip
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gearlab  # noqa: E402,F401  (pins the kernels)
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402


def _hash(t: torch.Tensor) -> str:
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return hashlib.blake2b(t.contiguous().numpy().tobytes(), digest_size=6).hexdigest()


class Tracer(TorchDispatchMode):
    def __init__(self, out) -> None:
        super().__init__()
        self.out, self.n = out, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(res)
        ts = [x for x in flat if isinstance(x, torch.Tensor) and x.device.type == "cpu" and not x.is_sparse]
        if func.__name__.startswith("_fused_adam"):  # in-place on its first argument (the parameters)
            ts = list(args[0])
        try:
            hs = ",".join(_hash(t) for t in ts)
            shapes = ";".join("x".join(map(str, t.shape)) + ":" + str(t.dtype)[6:] for t in ts)
        except Exception as e:  # noqa: BLE001 - a tensor numpy cannot view; name it and go on
            hs, shapes = f"unhashable({type(e).__name__})", ""
        self.out.write(f"{self.n} {func.__name__} {shapes} {hs}\n")
        self.n += 1
        return res


def trace(out_dir: Path, overrides: list[str]) -> None:
    import lightning.pytorch as pl

    from gearlab import cli
    from gearlab.models.checkpoints import weights_digest  # noqa: F401

    out_dir.mkdir(parents=True, exist_ok=True)
    digests = open(out_dir / "iterations.txt", "w")
    orig = pl.LightningModule.on_train_batch_end

    def on_end(self, *a, **k):  # noqa: ANN001 - the digest of every parameter after each iteration
        h = hashlib.sha256()
        for name, p in sorted(self.named_parameters()):
            h.update(name.encode() + p.detach().contiguous().numpy().tobytes())
        digests.write(f"{self.global_step} {h.hexdigest()[:16]}\n")
        digests.flush()
        return orig(self, *a, **k)

    pl.LightningModule.on_train_batch_end = on_end
    args = ["train", "experiment=embedded", "assigner=grpo", "trainer.seed=0", "trainer.accelerator=cpu",
            f"trainer.output_dir={out_dir}", "trainer.run_name=trace", "eval.num_problems=16",
            f"logging.tracking_uri=sqlite:///{out_dir}/mlflow.db", *overrides]
    with gzip.open(out_dir / "ops.txt.gz", "wt") as f, Tracer(f):
        rc = cli.main(args)
    print("rc", rc)


def compare(a: str, b: str) -> None:
    with gzip.open(a, "rt") as fa, gzip.open(b, "rt") as fb:
        prev: list[str] = []
        for la, lb in zip(fa, fb):
            if la != lb:
                print("first difference:\n  A " + la.rstrip() + "\n  B " + lb.rstrip())
                print("before it:\n  " + "\n  ".join(prev[-8:]))
                return
            prev.append(la.rstrip())
            prev = prev[-8:]
    print("no difference in the common length")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        trace(Path(sys.argv[1]), sys.argv[2:])
