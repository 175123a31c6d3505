"""The configuration's schema: one typed dataclass per section, each field's default and, in the comment beside
it, its meaning (``gearlab <command> --help`` prints those comments: gearlab.config_help). Loading, overrides and
validation are in gearlab.config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelConfig:
    # "embedded:tiny-arith" = the warm-started tiny model (made by `gearlab warmstart` if missing);
    # "embedded:tiny-random" = a freshly initialised tiny model; otherwise a local folder or hub id.
    name_or_path: str = "embedded:tiny-arith"
    # the parameters' dtype: auto = fp32 on CPU; on GPU bf16, but fp32 master weights under trainer.precision=bf16-mixed
    dtype: str = "auto"  # auto | float32 | bfloat16
    trust_remote_code: bool = False


@dataclass
class TaskConfig:
    name: str = "arith"
    options: dict[str, Any] = field(default_factory=dict)
    plugins: list[str] = field(default_factory=list)  # task modules / .py files to import first (they register tasks)
    eval_problems: int = 64
    # longest prompt (tokens after the chat template) a data file's row may have, checked with the file and row when
    # the data loads; 0 = only the model's limit (max_position_embeddings minus rollout.max_new_tokens)
    max_prompt_tokens: int = 0


@dataclass
class VLLMConfig:
    """``rollout.engine=vllm`` (gearlab.rollout.vllm): one colocated vLLM engine per training process."""

    # auto (inplace on GPU, reload on CPU) | inplace | reload (rebuild from a saved checkpoint)
    weight_sync: str = "auto"
    bucket_mb: float = 512  # inplace sync: parameters are sent in buckets of at most this many MB
    sleep: str = "auto"  # auto (on with CUDA) | on | off: free the engine's GPU memory during the update (sleep/wake)
    # vLLM sleep level: 1 offloads the weights to CPU and drops the KV cache; 2 drops both, and with them buffers
    # no checkpoint holds (the rotary cos/sin cache), so only a rebuild restores it; 0 = auto: 1 while weights sync
    # in place, 2 with weight_sync=reload (the engine is rebuilt after each wake)
    sleep_level: int = 0
    gpu_memory_utilization: float = 0.3  # share of each GPU the engine may take (weights + KV cache)
    tensor_parallel_size: int = 1  # >1: the engine spans this many of a node's training processes
    max_model_len: int = 0  # 0 = longest prompt budget + max_new_tokens, rounded up
    enforce_eager: bool = True  # no CUDA graphs: starts in seconds; false: graphs (4B on H200s: rollouts 4.4x faster)
    dtype: str = "auto"  # auto = the dtype the policy computes in: autocast's under bf16-mixed, else its parameters'
    cpu_kv_cache_gb: int = 1  # CPU backend only (VLLM_CPU_KVCACHE_SPACE)


@dataclass
class FastDecodeConfig:
    """``rollout.engine=fast`` (gearlab.rollout.fast): static-KV-cache decoding of the policy itself, each decode
    step one CUDA graph on GPUs; per-row seeds (row i of a call: seed + i)."""

    # auto (on with CUDA) | on | off: capture each decode step as a CUDA graph (on, CPU: its shapes, eagerly)
    cuda_graphs: str = "auto"
    bucket: int = 64  # attention covers the filled cache rounded up to this many tokens (one graph per bucket)
    check_every: int = 8  # decode steps between the checks whether every row has stopped (a host sync each)
    # torch.compile each layer's pieces around attention before capturing the step (fused kernels: 4.1 vs 6.8 ms a
    # step on an H100 at the 0.6B shape, ~2 s more in the first rollout); null = auto: on with CUDA
    compile: Optional[bool] = None
    # a sharded (FSDP) policy: gather = gather its weights at each call, capture its graphs anew, free both before the
    # update | replica = decode a persistent unsharded copy refreshed after each optimizer step: graphs survive, but
    # the copy (2 bytes/param in bf16) and the KV caches stay resident during the update
    sharded_weights: str = "gather"
    # q/k/v and gate/up as one GEMM each per layer, over copies of those weights in the compute dtype rewritten at
    # every call (memory: those projections' parameters once more, in bf16 0.55 / 4.39 / 8.44 GiB at Qwen3 0.6B / 4B
    # / 8B)
    fused_projections: bool = False
    # a decode step's attention: auto = split on CUDA with Triton (as reproducible as sdpa, 1.8x faster over an H200
    # bench iteration), else sdpa; the run's config.yaml and MLflow params record the kernel it resolved to |
    # sdpa = PyTorch's scaled_dot_product_attention without cuDNN's kernels (with them, processes on an H200 sampled
    # different tokens from the same weights and seeds; no decode kernel: at long caches it does not split the keys
    # across thread blocks) | sdpa_auto = SDPA's own choice (cuDNN on Hopper) | flex = compiled flex_attention, on
    # CUDA its split-K decode kernel (more thread blocks per row at small batches or long caches; two compiles per
    # batch size; eager on the CPU) | split = gearlab's split-K Triton kernel (gearlab.rollout.split_decode: K/V read
    # once per step, deterministic; on the CPU its PyTorch reference); prefill stays sdpa
    attention: str = "auto"
    # plain sampling's draw (no top-k / top-p, not greedy): torch = gearlab.rollout.sampler (a softmax and a two-level
    # inverse CDF, several passes over the vocabulary) | fused = gearlab.rollout.fused_sample (one pass over the
    # logits in Triton kernels on CUDA, its PyTorch reference elsewhere; the same distribution, the same token but
    # where rounding at an interval's edge differs)
    sampler: str = "torch"


@dataclass
class RolloutConfig:
    # auto: fast on CUDA (one GPU, DDP, FSDP1 or FSDP2) for the layouts gearlab's decoder runs (Qwen3/Qwen2/
    # Llama/Mistral), else hf; the run's config.yaml and MLflow params record the engine it resolved to |
    # hf (transformers generate) | fast (gearlab's static-cache decoder) | vllm
    engine: str = "auto"
    prompts_per_step: int = 16
    group_size: int = 8
    # must hold the answers: train warns where it cuts the task's median worked solution, naming the value that fits
    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off: the sampled distribution is exactly softmax(logits / T)
    batch_size: int = 64  # sequences per generate() call
    # engine=hf: a static KV cache, compiled by transformers on GPUs (first call compiles for ~40 s, then decode
    # steps are ~2.3× faster on an H100: experiments/bench/results/trl_vs_gearlab_h100.md); prompts are left-padded to a
    # multiple of 64 so shapes recur
    static_cache: bool = False
    # multi-turn tasks only: max_new_tokens caps ONE policy turn
    max_turns: int = 0  # policy turns per episode; 0 = the task's default
    max_total_tokens: int = 0  # response tokens (policy + environment) per episode; 0 = max_new_tokens × max_turns
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    fast: FastDecodeConfig = field(default_factory=FastDecodeConfig)


@dataclass
class AlgorithmConfig:
    """GRPO core (docs/grpo.md). Defaults follow verl, except that the dual clip is off (verl applies 3.0); DAPO's
    clip_high 0.28 is one override away."""

    scale_by_std: bool = True
    std_scope: str = "group"  # group | batch (TRL scale_rewards="batch")
    adv_eps: float = 1e-6
    leave_one_out: bool = False
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    # correction for rollouts sampled by another engine (rollout.engine=vllm): none | token_truncate | token_mask |
    # sequence_truncate | sequence_mask | icepop — each token's policy-gradient term × a detached weight from
    # π_old / π_engine (docs/grpo.md#rollout-engine-mismatch-and-importance-corrections)
    engine_is: str = "none"
    engine_is_cap: float = 2.0  # the upper bound of the ratio (truncated to it, or masked past it); >= 1
    engine_is_low: float = 0.5  # icepop: tokens with a ratio below this are masked too; in (0, 1]
    tis_cap: float = 0.0  # alias: C > 0 = engine_is=token_truncate with engine_is_cap=C; 0 = off
    agg: str = "token-mean"
    loss_scale_factor: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per epoch over one rollout batch
    micro_batch_size: int = 16  # sequences per forward/backward (gradient accumulation)
    packed: bool = False  # padding-free forwards: a micro-batch's sequences concatenated, block-diagonal attention
    # each micro-batch of the update and of the signal passes drops the columns padded in all its rows (its own
    # longest prompt and response, not the batch's); changes float rounding only. null = auto: on with CUDA; off on
    # the CPU, whose published digits were verified across CPU classes with the batch's widths
    crop_padding: Optional[bool] = None
    # > 0: dynamic micro-batches of at most this many real tokens (and micro_batch_size rows)
    micro_batch_tokens: int = 0


@dataclass
class AssignerConfig:
    # the method's label: MLflow tag `assigner`, comparison rows, run folders ("gear", a variant "gear_random", or a
    # grid point "gear:q_on=0.8"; gearlab.credit.methods)
    name: str = "grpo"
    base: str = ""  # the registered assigner the method builds; "" = name (a variant YAML sets it)
    options: dict[str, Any] = field(default_factory=dict)
    plugins: list[str] = field(default_factory=list)  # extra modules / .py files to import first


@dataclass
class OptimConfig:
    lr: float = 1e-4  # right for the 1.2M-param embedded model; use ~1e-6 for billion-parameter models
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine | linear
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 = off


@dataclass
class SignalConfig:
    chunk_size: int = 256  # positions per chunk for log-probs / entropy / KL (never a full B×T×V fp32 tensor)
    # true: on-policy runs of a method that needs only the policy's entropy and can be assigned micro-batch by
    # micro-batch (entropy_adv; entropy_fork with scope=micro_batch, normaliser=trl) take the entropy from the
    # update's own forward, with no separate pass | false: always a separate no-grad pass
    entropy_in_forward: bool = True
    # true: a method whose credit of a sequence with A_i != 0 ignores the signals of those with A_i = 0 (oar_g, oar_p)
    # gets its model-based signals only for the rows with A_i != 0 (the same credit; the all-alike groups, often
    # half of a batch or more, cost no saliency pass) | false: every row
    skip_zero_rows: bool = True


@dataclass
class TrainerConfig:
    max_steps: int = 80  # RL iterations (rollout + updates)
    seed: int = 0
    accelerator: str = "auto"
    devices: int = 1  # per node
    num_nodes: int = 1
    # auto = fsdp2 when more than one process in all, else a single device | ddp | fsdp2 | fsdp1 (GPU only)
    strategy: str = "auto"
    # on CUDA: deterministic kernels (torch.use_deterministic_algorithms, strict; cuBLAS's fixed workspace), so a run
    # repeats every iteration bit for bit on one kind of card. Without them the fused attention's backward sums in
    # the order the card schedules: two runs on an H100 differed from iteration 0's gradient. An op without such a
    # kernel stops the run with one line naming it; false runs it anyway. No effect on a CPU run
    deterministic: bool = True
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (HF gradient checkpointing)
    # torch.compile each decoder layer for the cache-free forwards (update, log-probs, signals; decoding stays
    # eager) and the log-prob head chunks: fuses the elementwise work between matmuls (gearlab.parallel.compiling)
    compile: bool = False
    cpu_offload: bool = False  # fsdp2: parameters, gradients and optimizer state live on CPU (FSDP2 CPUOffloadPolicy)
    precision: str = "32-true"
    output_dir: str = "runs"
    run_name: str | None = None  # default: <task>-<assigner>-s<seed>
    checkpoint_every: int = 10
    resume: str = "auto"  # auto (resume the run's last checkpoint if any) | never | a checkpoint path
    max_nonfinite: int = 3  # consecutive non-finite losses before the run stops (after a checkpoint)
    # an iteration whose groups all scored their samples alike has no learning signal (every GRPO advantage is 0):
    # each one is a warning line; this many in a row (and every as many after) a louder one; 0 = no louder one
    no_signal_patience: int = 3
    reward_errors: str = "zero"  # zero (score 0 and count) | raise
    log_every: int = 1
    # stop cleanly after this many iterations in this process, with a checkpoint (time-limited cluster jobs:
    # the same command resumes); 0 = run to max_steps
    stop_after: int = 0
    # stop cleanly, with a checkpoint, at the first iteration boundary after this Unix time (0 = never): a job with
    # a wall-clock limit ends resumable, e.g. trainer.deadline=$(date -d '+50 min' +%s); compare.max_minutes sets it
    deadline: float = 0.0
    # evaluation on the task's test split every N iterations (0 = only before the first and after the last)
    eval_every: int = 0
    progress_bar: bool = True
    # intra-op CPU threads (torch.set_num_threads); 0 = torch's default (the machine's cores). Floating-point
    # reduction order depends on it, and small CPU runs are sensitive to that: fix it to get the same numbers on
    # another machine (gearlab compare gives each child this many, or cores / workers when 0)
    threads: int = 0


@dataclass
class LoggingConfig:
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///<output_dir>/mlflow.db
    experiment: str = "gearlab"
    tags: dict[str, str] = field(default_factory=dict)
    parent_run_id: str | None = None  # set by `gearlab compare`: the comparison's parent MLflow run


@dataclass
class WarmstartConfig:
    # SFT steps of batch_size problems; the default recipe's result is shipped in the package (gearlab.models.shipped)
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    max_minutes: float | None = None
    # intra-op CPU threads during the warm start, fixed rather than taken from the machine: the tiny model's SFT
    # is sensitive to float reduction order (another thread count gives other weights, hence other results)
    threads: int = 2
    device: str = "cpu"  # cpu | cuda | auto (cuda when available); the CPU figures in the README are for cpu
    bf16: bool = False  # bf16 autocast (worth it on a GPU with the small size)
    n_eval: int = 200  # held-out problems the warm start is evaluated on (greedy, sampled, privileged); 0 = none


@dataclass
class ExportConfig:
    checkpoint: str | None = None  # a Lightning checkpoint: a file, or a sharded (FSDP2) checkpoint directory
    out: str | None = None  # the Hugging Face folder to write


@dataclass
class EvalConfig:
    checkpoint: str | None = None  # a Lightning checkpoint or an HF folder; None = model.name_or_path
    num_problems: int = 200  # test-split problems per evaluation (held out unless the task has no test split); 0 = none
    k: int = 4
    temperature: float = 1.0
    # also decode each problem greedily (eval/greedy_accuracy): a fifth of the decoding at k=4; the sampled metrics
    # (avg@k, pass@k) are the same digits with it off (their rows carry their own seeds)
    greedy: bool = True
    # the held-out problems and the sampling seed of the evaluation: -1 = trainer.seed (each seed its own problems);
    # a fixed value evaluates every run of a comparison on the same problems with the same random numbers
    seed: int = -1
    # reuse the evaluation before the first iteration when the same starting weights were already evaluated with
    # the same settings (single process; cached under <output_dir>/.eval_cache/)
    cache_start: bool = True


@dataclass
class CompareConfig:
    name: str = "embedded"  # the comparison id; re-running the same name resumes it
    assigners: list[str] = field(default_factory=lambda: ["grpo", "gear"])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    workers: int = 1  # >1: children run as parallel processes
    # the GPUs the workers are spread over, round-robin (worker i sees only gpus[i % len(gpus)], as its cuda:0).
    # None: every visible CUDA device (CUDA_VISIBLE_DEVICES, else all; nothing is set with fewer than two);
    # []: no pinning, every child sees every GPU and uses the first
    gpus: list[int] | None = None
    baseline: str = "grpo"
    # the primary metric, named before the comparison runs (recorded on its parent run): the final value of each
    # child. Default: the evaluation's avg@k (k samples per problem on eval.num_problems problems), far less noisy
    # than greedy accuracy on the same problems. "auto" = eval/avg_at_<eval.k> (the MLflow name; eval/avg@4 is
    # accepted and means eval/avg_at_4)
    metric: str = "auto"
    # option grids, expanded into one method per point: compare.grid.gear.q_on=[0.8,0.9] runs gear:q_on=0.8 and
    # gear:q_on=0.9 in place of gear (gearlab.credit.methods)
    grid: dict[str, Any] = field(default_factory=dict)
    effect: float = 0.03  # the difference the power line asks about (metric units: 0.03 = 3 points of accuracy)
    target: float | None = None  # accuracy to reach for "steps to target" (None: skip that column)
    # more per-iteration metrics the report plots across methods like the training accuracy, e.g.
    # [credit/adv_std,credit/sign_flip_frac]: one curves_<metric>.png each
    curves: list[str] = field(default_factory=list)
    # stop the comparison after this many minutes (0 = no limit): running children stop at their next iteration
    # boundary with a checkpoint (trainer.deadline), queued ones are not started; the same command resumes
    max_minutes: float = 0.0
    # a pretrained model.name_or_path is first fine-tuned on the task's demonstrations (the warmstart settings, as
    # `gearlab warmstart` does), once; every child starts from that folder. The embedded tiny models are always
    # warm-started (or copied from the shipped one)
    warm_start: bool = False


@dataclass
class ReplayConfig:
    rollouts: str = "rollouts.pt"  # cached rollout file: read if it exists, else sampled and written here
    assigners: list[str] = field(default_factory=list)  # empty = every applicable one
    prompts: int = 16


@dataclass
class CreditEvalConfig:
    """``gearlab credit-eval`` (gearlab.commands.credit_eval): credit scored against the located first error."""

    rollouts: str = ""  # a replay file: read if it exists, else sampled and written there; "" = sample, do not save
    assigners: list[str] = field(default_factory=list)  # empty = every method that applies to the task
    controls: bool = True  # when gear is scored, also score gear_random, gear_fixed and shuffle (of gear)
    prompts: int = 64  # test problems sampled (× rollout.group_size responses)
    out_dir: str = "credit_eval"
    # train / compare: after the last iteration, score the final model's rollouts and log credit_eval/ to the run
    after_training: bool = False
    # what the credit is scored against: located (the task's located first error) | mc (Monte-Carlo step values from
    # continuations of every response: any task with a verifier) | both
    truth: str = "located"
    mc_k: int = 8  # truth=mc: continuations per step end
    mc_max_steps: int = 8  # truth=mc: steps per response at most (later steps merge into the last)


@dataclass
class InspectConfig:
    assigners: list[str] = field(default_factory=list)  # empty = every registered one that applies to the task
    prompts: int = 4
    out_dir: str = "inspect"
    shared_scale: bool = False  # pictures: one colour scale (global max |A|) for all rows; False = each row its own


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    assigner: AssignerConfig = field(default_factory=AssignerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    signals: SignalConfig = field(default_factory=SignalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    inspect: InspectConfig = field(default_factory=InspectConfig)
    credit_eval: CreditEvalConfig = field(default_factory=CreditEvalConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
