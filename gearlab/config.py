"""Typed configuration: the dataclass schema (gearlab.config_schema) + YAML files in ``conf/`` + dotted
command-line overrides.

Resolution order (later wins): schema defaults ← ``experiment=NAME`` ← group selections
(``assigner=NAME``, ``task=NAME``, ``model=NAME``) ← dotted overrides (``trainer.max_steps=20``).
Unknown keys and wrong types raise ``ConfigError`` naming the key path, before any work.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gearlab.config_schema import Config
from gearlab.core.grpo import AGG_MODES, ENGINE_IS_MODES, KL_KINDS
from gearlab.errors import ConfigError  # noqa: F401  (re-exported: gearlab.config.ConfigError)

# Groups selectable as ``group=name`` on the command line; each maps to conf/<group>/<name>.yaml,
# merged at the given key ("" = the root).
GROUPS = {"assigner": "assigner", "task": "task", "model": "model", "experiment": ""}


def conf_dir() -> Path:
    """The YAML directory: $GEARLAB_CONF_DIR, else the checkout's top-level ``conf/`` (a source tree or an
    editable install), else the copy installed inside the package (``gearlab/conf/``, a wheel)."""
    env = os.environ.get("GEARLAB_CONF_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    checkout = here.parent / "conf"
    return checkout if (checkout / "experiment").is_dir() and (
        here.parent / "pyproject.toml"
    ).is_file() else here / "conf"


def _merge(base: DictConfig, other: Any, where: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {_describe(e)}") from None


def _describe(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    return f"key '{key}': {msg}" if key else msg


def load_yaml(path: Path) -> Any:
    """One YAML file of ``conf/`` as an OmegaConf node; a syntax error is a ConfigError naming the file and line."""
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark, start = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
        mark = mark or start
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        # the construct that was left open, e.g. "while parsing a flow sequence" (line 2) for an error found at line 3
        if getattr(e, "context", None) and start is not None and start.line != mark.line:
            what += f" ({e.context} that starts at line {start.line + 1})"
        raise ConfigError(f"{where}: YAML syntax error: {what}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _load_group(group: str, name: str) -> Any:
    path = conf_dir() / group / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
        raise ConfigError(f"no {group} named {name!r} (looked for {path.name}); known: {', '.join(known) or 'none'}")
    data = load_yaml(path)
    key = GROUPS[group]
    return OmegaConf.create({key: data}) if key else data


def load_config(overrides: list[str] | None = None) -> Config:
    """Build the resolved, validated config from command-line style overrides.

    ``overrides`` items are ``group=name`` (a YAML of conf/<group>/) or ``a.b.c=value`` (dotted key).
    Returns an OmegaConf structured config typed as ``Config``.
    """
    cfg: DictConfig = OmegaConf.structured(Config)
    groups: list[tuple[str, str]] = []
    dotted: list[str] = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        if key in GROUPS and "." not in key:
            groups.append((key, value))
        else:
            dotted.append(item)
    # experiment first so that explicit group selections and dotted keys override it
    groups.sort(key=lambda kv: kv[0] != "experiment")
    for group, name in groups:
        if group == "assigner":
            cfg = _merge(cfg, _method_node(name), f"assigner={name}")
            continue
        cfg = _merge(cfg, _load_group(group, name), f"conf/{group}/{name}.yaml")
    import yaml

    for item in dotted:
        try:
            node = OmegaConf.from_dotlist([item])
        except yaml.YAMLError as e:  # the value is read as YAML: an unclosed [ or a stray quote
            raise ConfigError(
                f"override {item!r}: the value is not valid YAML ({getattr(e, 'problem', None) or e})"
            ) from None
        cfg = _merge(cfg, node, f"override {item!r}")
    validate(cfg)  # type: ignore[arg-type]
    return cfg  # type: ignore[return-value]


def parse_label(label: str) -> tuple[str, dict[str, Any]]:
    """A method label ``"gear:q_on=0.8,beta=2"`` → ``("gear", {"q_on": 0.8, "beta": 2})`` (values read as YAML
    scalars); a label without a colon has no extra options. ConfigError on a malformed option list."""
    import yaml

    head, sep, tail = label.partition(":")
    opts: dict[str, Any] = {}
    if sep:
        for item in tail.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"method {label!r}: {item!r} is not KEY=VALUE (write {head}:key=value,key=value)")
            opts[key.strip()] = yaml.safe_load(value)
    return head, opts


def method_yaml(label: str) -> dict[str, Any] | None:
    """The ``assigner`` node of a method label from ``conf/assigner/``: ``{"name": label, "base": registered
    assigner, "options": {...}, ...}``, a variant's options on top of its base's YAML and a grid point's on top of
    both; None when there is no YAML for the label's head (a plug-in, or an unknown name, which preflight reports)."""
    head, extra = parse_label(label)
    path = conf_dir() / "assigner" / f"{head}.yaml"
    if not path.is_file():
        return None
    data = OmegaConf.to_container(load_yaml(path)) or {}
    base = str(data.get("base") or data.get("name") or head)
    opts = dict(data.get("options") or {})
    if base != head:  # a variant: its base's YAML options first
        inner = method_yaml(base)
        if inner is not None:
            base, opts = inner["base"], {**inner["options"], **opts}
    return {**data, "name": label, "base": base, "options": {**opts, **extra}}


def _method_node(label: str) -> DictConfig:
    node = method_yaml(label)
    if node is None:  # a plug-in without a YAML: its defaults are its own; an unknown name fails at preflight
        head, extra = parse_label(label)
        node = {"name": label, "base": head, "options": extra}
    return OmegaConf.create({"assigner": node})


_CHOICES = {
    "algorithm.agg": AGG_MODES,  # the core's own lists: one place
    "algorithm.std_scope": ("group", "batch"),
    "algorithm.kl_kind": KL_KINDS,
    "algorithm.engine_is": ENGINE_IS_MODES,
    "optim.schedule": ("constant", "cosine", "linear"),
    "trainer.reward_errors": ("zero", "raise"),
    "model.dtype": ("auto", "float32", "bfloat16"),
    "rollout.engine": ("auto", "hf", "fast", "vllm"),
    "credit_eval.truth": ("located", "mc", "both"),
    "rollout.fast.cuda_graphs": ("auto", "on", "off"),
    "rollout.fast.attention": ("auto", "sdpa", "sdpa_auto", "flex", "split"),
    "rollout.fast.sampler": ("torch", "fused"),
    "rollout.fast.sharded_weights": ("gather", "replica"),
    "rollout.vllm.weight_sync": ("auto", "inplace", "reload"),
    "rollout.vllm.sleep": ("auto", "on", "off"),
    "rollout.vllm.dtype": ("auto", "float32", "bfloat16", "float16"),
    "trainer.strategy": ("auto", "ddp", "fsdp2", "fsdp1"),
    "warmstart.device": ("cpu", "cuda", "auto"),
}
_POSITIVE = ("rollout.prompts_per_step", "rollout.group_size", "rollout.max_new_tokens", "rollout.batch_size",
             "algorithm.ppo_epochs", "algorithm.mini_batches", "algorithm.micro_batch_size",
             "signals.chunk_size", "trainer.max_steps", "trainer.checkpoint_every", "trainer.max_nonfinite",
             "trainer.devices", "trainer.num_nodes", "rollout.vllm.bucket_mb", "rollout.vllm.tensor_parallel_size",
             "credit_eval.prompts")


def validate(cfg: Config) -> None:
    """Value checks the schema cannot express; raises ConfigError naming the key."""
    for key, choices in _CHOICES.items():
        v = OmegaConf.select(cfg, key)
        if v not in choices:
            raise ConfigError(f"key '{key}': {v!r} is not one of {', '.join(map(str, choices))}")
    for key in _POSITIVE:
        v = OmegaConf.select(cfg, key)
        if v <= 0:
            raise ConfigError(f"key '{key}': must be > 0, got {v}")
    if cfg.rollout.temperature <= 0:
        raise ConfigError("key 'rollout.temperature': must be > 0 (greedy decoding is for eval, not GRPO)")
    if cfg.algorithm.dual_clip is not None and cfg.algorithm.dual_clip <= 1:
        raise ConfigError(f"key 'algorithm.dual_clip': must be > 1, got {cfg.algorithm.dual_clip}")
    alg = cfg.algorithm
    if alg.tis_cap != 0 and alg.tis_cap < 1:
        raise ConfigError(f"key 'algorithm.tis_cap': must be 0 (off) or >= 1, got {alg.tis_cap}")
    if alg.tis_cap and cfg.rollout.engine in ("hf", "auto"):
        raise ConfigError(
            "key 'algorithm.tis_cap': the correction needs the engine's log-probs (set rollout.engine=vllm or fast)"
        )
    if alg.tis_cap:  # the older spelling of token truncation
        if alg.engine_is not in ("none", "token_truncate"):
            raise ConfigError(
                "key 'algorithm.tis_cap': it means engine_is=token_truncate, but algorithm.engine_is is "
                f"{alg.engine_is!r}"
            )
        alg.engine_is, alg.engine_is_cap = "token_truncate", float(alg.tis_cap)
    if alg.engine_is != "none" and cfg.rollout.engine in ("hf", "auto"):
        raise ConfigError(
            "key 'algorithm.engine_is': the correction needs the engine's log-probs (set rollout.engine=vllm or fast)"
        )
    for key in ("bucket", "check_every"):
        if getattr(cfg.rollout.fast, key) < 1:
            raise ConfigError(f"key 'rollout.fast.{key}': must be >= 1, got {getattr(cfg.rollout.fast, key)}")
    if alg.engine_is_cap < 1:
        raise ConfigError(f"key 'algorithm.engine_is_cap': must be >= 1, got {alg.engine_is_cap}")
    if not 0 < alg.engine_is_low <= 1:
        raise ConfigError(f"key 'algorithm.engine_is_low': must be in (0, 1], got {alg.engine_is_low}")
    if not 0 < cfg.rollout.vllm.gpu_memory_utilization <= 1:
        raise ConfigError(
            "key 'rollout.vllm.gpu_memory_utilization': must be in (0, 1], got "
            f"{cfg.rollout.vllm.gpu_memory_utilization}"
        )
    if cfg.credit_eval.mc_k < 2 or cfg.credit_eval.mc_max_steps < 1:
        raise ConfigError("key 'credit_eval.mc_k' / 'credit_eval.mc_max_steps': need mc_k >= 2 (a standard error) and "
                          f"mc_max_steps >= 1, got {cfg.credit_eval.mc_k} and {cfg.credit_eval.mc_max_steps}")
    if cfg.rollout.vllm.sleep_level not in (0, 1, 2):
        raise ConfigError(
            f"key 'rollout.vllm.sleep_level': must be 0 (auto), 1 or 2, got {cfg.rollout.vllm.sleep_level}"
        )
    if cfg.rollout.vllm.sleep_level == 2 and cfg.rollout.vllm.weight_sync != "reload":
        raise ConfigError(
            "key 'rollout.vllm.sleep_level': 2 needs rollout.vllm.weight_sync=reload — level 2 drops the rotary "
            "cos/sin cache, which an in-place weight sync does not restore (the engine would sample from garbage)"
        )
    if cfg.trainer.no_signal_patience < 0:
        raise ConfigError(
            "key 'trainer.no_signal_patience': must be >= 0 (0 = no louder warning), got "
            f"{cfg.trainer.no_signal_patience}"
        )
    if cfg.task.max_prompt_tokens < 0:
        raise ConfigError(
            f"key 'task.max_prompt_tokens': must be >= 0 (0 = the model's limit only), got {cfg.task.max_prompt_tokens}"
        )
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if n % cfg.algorithm.mini_batches:
        raise ConfigError(
            f"key 'algorithm.mini_batches': {cfg.algorithm.mini_batches} does not divide the {n} sequences of a step"
        )


def check_output_dir(cfg: Config) -> None:
    """``trainer.output_dir`` can hold this command's files: it, or the nearest folder above it that exists, is a
    writable directory. Raises a one-line ConfigError otherwise; creates nothing."""
    import tempfile

    want = Path(cfg.trainer.output_dir).expanduser().absolute()
    probe = want
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"key 'trainer.output_dir': cannot create {want}: {probe} is not a directory")
    try:
        # an anonymous file that vanishes when closed: also catches what os.access misses (root on a read-only
        # mount, ACLs)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ConfigError(f"key 'trainer.output_dir': {want} is not writable ({probe}: {e.strerror})") from None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def flatten(cfg: Config) -> dict[str, Any]:
    """Dotted-key → value, for MLflow params."""
    out: dict[str, Any] = {}

    def rec(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                rec(v, f"{prefix}{k}." if not isinstance(v, dict) or v else f"{prefix}{k}")
            if not node and prefix:
                out[prefix.rstrip(".")] = "{}"
        else:
            out[prefix.rstrip(".")] = node

    rec(OmegaConf.to_container(cfg, resolve=True), "")
    return out
