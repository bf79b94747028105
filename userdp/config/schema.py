"""The config's sections: frozen, strict pydantic models that forbid unknown keys, one per TOML
table, each key with its range and its meaning."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool

from userdp.accounting.validation import in_interval, interval_text
from userdp.strategies.catalogue import BUILTIN_STRATEGIES


class ConfigError(ValueError):
    """The config file is missing, not TOML, or fails validation (one line per problem)."""


def _interval(lo: float, hi: float, lo_open: bool = True, hi_open: bool = True):
    """A validator for a real number in an interval; its message states the interval."""
    text = interval_text(lo, hi, lo_open=lo_open, hi_open=hi_open)

    def check(value: float) -> float:
        if not in_interval(value, lo, hi, lo_open=lo_open, hi_open=hi_open):
            raise ValueError(f"must be in {text}, got {value:g}")
        return value

    return AfterValidator(check)


Positive = Annotated[float, _interval(0.0, math.inf)]
NonNegative = Annotated[float, _interval(0.0, math.inf, lo_open=False)]
Probability = Annotated[float, _interval(0.0, 1.0, hi_open=False)]
OpenUnit = Annotated[float, _interval(0.0, 1.0)]


def _at_least(lo: int):
    """A validator for an integer ≥ ``lo``; its message states the bound as the others do."""

    def check(value: int) -> int:
        if not in_interval(value, lo, math.inf, lo_open=False):
            raise ValueError(f"must be an integer >= {lo}, got {value}")
        return value

    return AfterValidator(check)


PositiveInt = Annotated[int, _at_least(1)]
NonNegativeInt = Annotated[int, _at_least(0)]


class _Section(BaseModel):
    """Strict: a TOML string is never read as a number (``steps = "80"`` is an error)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _seq_len(value: int) -> int:
    if value < 2:
        raise ValueError(
            f"= {value} leaves no token to train on: a causal LM predicts each token from the ones "
            "before it, so an example needs at least 2 tokens (the first is never a target); set "
            "data.seq_len >= 2 (the default is 128)"
        )
    return value


class DataConfig(_Section):
    """Where the user-partitioned shards are and how a worker selects a user's examples."""

    shards: str | None = None
    """Directory written by ``userdp shard`` (holds ``manifest.json``). None = the embedded demo corpus."""
    demo_users: PositiveInt = 400
    """Number of users of the embedded synthetic corpus when ``shards`` is not set."""
    eval_fraction: Annotated[float, _interval(0.0, 1.0, lo_open=False, hi_open=True)] = 0.1
    """Fraction of users held out (user-level split) for evaluation; they are never trained on."""
    selection: Literal[
        "random", "longest", "shortest", "random_chunk", "highest_ppl", "lowest_ppl"
    ] = "random"
    """Which of a user's examples are used (the selection strategies of "Mind the Privacy Unit!
    User-Level Differential Privacy for Language Model Fine-Tuning", §4.1, §5.1): for user-level
    strategies, ``group_size`` of them each step; for ``els`` and ``group-privacy``, the
    ``group_size`` records per user of the subset D_sub chosen once (``random_chunk``, windows
    across records, is user-level only). ``highest_ppl`` / ``lowest_ppl`` rank them by
    perplexity under the initial model, which each worker computes once at start
    (docs/data.md)."""
    seq_len: Annotated[int, AfterValidator(_seq_len)] = 128
    """Maximum tokens per example fed to the model: at least 2 (a causal LM learns to predict
    token t+1 from tokens ≤ t, so a window of one token has no target) and at most the model's
    positions (a preset's position table is built for it, up to ``PRESET_MAX_SEQ_LEN``)."""


def _zero_stage(value: int) -> int:
    if value not in (0, 1, 2, 3):
        raise ValueError(f"must be 0, 1, 2 or 3, got {value!r}")
    return value


def _lora_dropout(value: float) -> float:
    if value != 0.0:
        raise ValueError(
            f"= {value:g}: only 0 is supported. Workers compute per-unit gradients with the model "
            "in eval mode, so that a unit's gradient depends only on the model and its data and "
            "every clipping engine (and their cross-checks) computes the same quantity; dropout "
            "would be silently off"
        )
    return value


class ModelConfig(_Section):
    """The causal LM: a preset built from a transformers config, or any local folder that
    ``AutoModelForCausalLM.from_pretrained(local_files_only=True)`` loads (no hub downloads)."""

    preset: (
        Literal["gpt2-tiny", "gpt2-small", "gpt2-medium", "llama-tiny", "llama-small"] | None
    ) = "gpt2-tiny"
    path: str | None = None
    """A local folder with a transformers causal LM (config.json, safetensors); overrides
    ``preset``. Any family AutoModelForCausalLM loads (Llama, Mistral, Qwen2, Gemma, Phi,
    GPT-NeoX, OPT, GPT-2, ...), fp32 or bf16, tied or untied embeddings."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    zero_stage: Annotated[int, AfterValidator(_zero_stage)] = 0
    """DeepSpeed ZeRO stage on workers (0-3; 3 partitions the parameters over a worker's ranks,
    docs/models.md); a ``deepspeed_config`` file's stage wins."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON config (DeepSpeed's own format) passed to ``deepspeed.initialize`` on
    workers; the keys userdp controls (batch sizes, optimizer, scheduler, bf16) are overridden
    and the worker logs which in one line."""
    lora_rank: NonNegativeInt = 0
    """0 = full fine-tuning; > 0 trains LoRA adapters of this rank (needs the ``peft`` extra)."""
    lora_target_modules: list[str] | None = None
    """Module names (suffixes) that get adapters; default: PEFT's targets for the model type,
    or every Linear layer of attention and MLP (PEFT's "all-linear") for types it does not know."""
    lora_alpha: Positive | None = None
    """LoRA scaling numerator (scale = alpha / rank); default 2 x rank."""
    lora_dropout: Annotated[float, AfterValidator(_lora_dropout)] = 0.0
    """Must be 0 (see the error for why)."""


PLUGIN_NAME = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def _strategy_name(value: str) -> str:
    if value in BUILTIN_STRATEGIES or PLUGIN_NAME.match(value):
        return value
    raise ValueError(
        f"must be a built-in strategy ({', '.join(BUILTIN_STRATEGIES)}) or a plugin "
        f"'package.module:ClassName', got {value!r}"
    )


class StrategyConfig(_Section):
    """The DP mechanism: privacy unit, sampling, clipping, server update."""

    name: Annotated[str, AfterValidator(_strategy_name)] = "uls"
    """A built-in strategy, or a plugin ``"package.module:ClassName"`` (a subclass of
    ``userdp.strategies.Strategy``, importable from ``plugin_path`` or ``PYTHONPATH``)."""
    params: dict[str, Any] = {}
    """Plugins only: keyword arguments of the plugin's constructor (docs/strategies.md)."""
    plugin_path: str | None = None
    """Plugins only: the folder the plugin module is imported from (before ``PYTHONPATH``);
    default: the config file's folder."""
    sampling: Literal[
        "poisson",
        "balls-in-bins-fixed",
        "balls-in-bins-epoch",
        "cyclic-poisson",
        "shuffle",
        "padding",
    ] = "poisson"
    sampling_prob: Probability = 0.05
    """q: each user (ULS) or example of D_sub (ELS) is included in a step with this probability
    (``cyclic-poisson``: the rate within the step's group)."""
    bands: PositiveInt | None = None
    """blt-dp-ftrl with ``sampling = "cyclic-poisson"`` only (required there): b̂, the number of
    user groups; step t samples group t mod b̂ and C is a banded matrix with b̂ bands optimized
    for the run (accounted as banded matrix factorization with cyclic Poisson sampling)."""
    group_size: PositiveInt = 8
    """G: examples per user per step (ULS) or the contribution bound per user (ELS)."""
    clip_norm: Positive = 1.0
    """C: every unit's gradient is clipped to this L2 norm."""
    steps: PositiveInt = 100
    expected_cohort_size: Positive | None = None
    """User-level strategies: the normalizer of the noisy sum (expected users per step), fixed in
    advance (e.g. q times a public user count). Unset: qN (N/b for balls-in-bins) from the
    training users, which treats N as public (the report says so)."""
    expected_batch_size: Positive | None = None
    """els / group-privacy: the normalizer (expected examples per step), fixed in advance. Unset:
    p|D_sub| from the users' example counts, which treats them as public (the report says so)."""
    sampler_seed: NonNegativeInt | None = None
    """Seeds the sampler that picks each step's cohort. Unset (the default): a secret seed from
    os.urandom, kept only in checkpoints, as amplification by sampling assumes. Set it only for
    research reruns: the report then says the seed was given (``output.seed`` never seeds it)."""
    engine: Literal["loop", "vectorized", "randomized"] = "vectorized"
    probes: PositiveInt = 32
    """k: probes for the randomized engine (Hutch++: k per probe matrix)."""
    estimator: Literal["hutchinson", "hutch++"] = "hutchinson"
    """randomized-clipping only: the norm estimator. ``hutch++`` costs four k-wide passes and a
    QR per unit and weight instead of one pass, and is exact when a gradient has rank ≤ k; both
    are accounted with the same envelope (k = ``probes``)."""
    server_optimizer: Literal["sgd", "momentum", "adam", "adafactor"] = "adam"
    server_lr: Positive = 1e-3
    momentum: Annotated[float, _interval(0.0, 1.0, lo_open=False)] = 0.9
    local_steps: PositiveInt = 1
    """DP-FedAvg only: local optimizer steps per user before the model delta is clipped."""
    local_lr: Positive = 0.1
    """DP-FedAvg only: learning rate of the users' local SGD steps."""
    concentration_threshold: Positive | None = None
    """τ, user-wise-filter only (required there): the L2 radius within which users' clipped
    gradients count as concentrated; the noise scales with τ instead of ``clip_norm``."""


class PrivacyConfig(_Section):
    """The privacy target. With ``noise_multiplier`` unset, σ is calibrated to (epsilon, delta)."""

    epsilon: Positive = 8.0
    delta: OpenUnit | None = None
    """None = 1/(10·N) with N the number of training users."""
    noise_multiplier: Positive | None = None
    allow_unaccounted_sampling: StrictBool = False
    """Must be true to use ``shuffle`` sampling, for which no tight accountant exists."""
    secure_noise: StrictBool = True
    """Noise from an AES-256-CTR keystream, each release rounded onto a grid finer than std/256
    (closes predictable generators and floating-point low-bit leaks). false = numpy/torch
    generators in floating point: faster, and the privacy report says the noise is unprotected."""


class CoordinatorConfig(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 0
    """0 = pick a free port (simulate tells its workers); a deployment sets a fixed one. A set
    port that is in use stops the run with one line naming this key (simulate and train)."""
    step_deadline_s: Positive = 300.0
    worker_startup_s: Positive = 1800.0
    """The longest wait for every shard to have a ready worker before step 1 (workers report
    their start-up phase while they load the model and build DeepSpeed's op)."""
    worker_stall_s: Positive = 300.0
    """While waiting for workers: fail when every worker still starting has sent nothing for
    this long (its process died or lost the coordinator; a worker reports from a background
    thread, so one hung inside a phase is ended by worker_startup_s). Before any worker has
    reported only worker_startup_s applies."""
    checkpoint_every: PositiveInt = 10
    max_message_mb: Annotated[int, Field(ge=1, le=2047)] = 64
    auth_token_file: str | None = None
    tls_dir: str | None = None
    """Directory with ca.pem, <role>.pem and <role>.key for mTLS (see ``userdp certs``)."""
    data_plane: Literal["grpc", "collective"] = "grpc"
    """How model-size tensors move. ``"grpc"``: every worker streams its clipped sums to the
    coordinator and receives every new model version from it (simple; fits small models and
    workers that cannot reach each other). ``"collective"``: the step's workers form a
    torch.distributed gloo process group, reduce their sums to one leader, which alone sends the
    sum and receives the new version, and broadcast it among themselves: the coordinator's
    bytes per step do not grow with the number of workers (docs/protocol.md). Workers must reach
    each other and the coordinator's ``group_port``."""
    group_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """``data_plane = "collective"``: the port of the coordinator's rendezvous store (a
    torch.distributed TCPStore); 0 = pick a free port (simulate); a deployment sets a fixed one.
    A set port that is in use stops the run with one line naming this key."""
    group_timeout_s: Positive = 300.0
    """``data_plane = "collective"``: a collective of the workers' group fails after this long
    (a member died); the step is then aborted and retried by a new group."""


class WorkersConfig(_Section):
    count: PositiveInt = 2
    replicas: PositiveInt = 1
    """How many workers hold each shard; > 1 lets a step finish when a worker dies."""
    device: Literal["cpu", "cuda"] = "cpu"
    ranks: PositiveInt = 1
    """Processes (ranks) per worker that ``simulate`` starts, under torch's own launcher
    (``python -m torch.distributed.run --standalone``): each worker's ranks form their own
    process group, split its units and reduce their clipped sums; with ``model.zero_stage = 3``
    they partition the model. On CUDA rank r of every worker uses GPU r (the workers of one
    machine share its GPUs). A deployment sets its ranks with the chart's ``workers.gpus``
    (``userdp deploy render --gpus``) instead."""
    token_budget: PositiveInt = 8192
    """Padded tokens per micro-batch; bounds worker memory. At least ``data.seq_len`` (one
    example window); a unit over the budget runs in example chunks."""
    tensor_core_matmul: StrictBool = True
    """Vectorized engines on CUDA with bf16 activations (a bf16 model, or autocast; otherwise
    every GEMM is IEEE float32 and this changes nothing): run the
    per-unit norm and book-keeping products as bf16 GEMMs on the tensor cores (about 1.6x faster
    end to end on an H100) instead of IEEE float32 GEMMs. Tensor-core accumulation is not IEEE,
    so each unit is clipped by a proven bound on the norm of what it releases (clipping a little
    harder; docs/worker.md, "Tensor cores: a proven norm bound"). false: IEEE float32 GEMMs,
    whose norms and sums carry float32 rounding only."""
    reconnect_timeout_s: NonNegative = 600.0
    """How long a worker that lost its coordinator keeps reconnecting (a restarted coordinator
    picks it up again) before it exits with status 4; 0 = forever. It bounds how long a worker
    outlives a dead coordinator: its stream breaks at once when the coordinator's process dies,
    within 30 s (gRPC keepalive) when the coordinator's host goes silent. ``userdp worker
    --reconnect-timeout`` overrides it; ``simulate``'s workers also end with ``simulate``
    (docs/protocol.md, "Workers outliving their coordinator")."""
    cache_dir: str | None = None
    """Where a worker caches the per-example perplexities of ``data.selection = "highest_ppl" |
    "lowest_ppl"`` (keyed by model and shard sha256); default: ``cache/`` in the shard folder.
    Set it when the shards are read-only; the cache is as private as the shards."""


class OutputConfig(_Section):
    dir: str = "runs/latest"
    plots: StrictBool = True
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = []
    """Experiment trackers that get the metrics and the privacy report, as HF Trainer's
    ``report_to`` (each an optional extra: ``userdp[tracking]`` for tensorboard and mlflow,
    ``userdp[wandb]``); see userdp/run/tracking.py for where each writes."""
    sample_prompts: list[str] | None = None
    """Prompts whose continuations go to ``samples.jsonl`` and the report's appendix after the
    last evaluation; default: the first tokens of a few held-out users' first example (those
    users are outside ε: their text stays in samples.jsonl, the report only counts them)."""
    sample_count: NonNegativeInt = 4
    """How many held-out users' prompts to use when ``sample_prompts`` is not set (0 = none)."""
    sample_max_new_tokens: PositiveInt = 32
    seed: NonNegativeInt | None = None
    """Seeds model init for reproducible research runs; never the cohort sampler
    (``strategy.sampler_seed``, secret by default) nor the noise (always from os.urandom)."""


class Config(_Section):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    strategy: StrategyConfig = StrategyConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    workers: WorkersConfig = WorkersConfig()
    output: OutputConfig = OutputConfig()
