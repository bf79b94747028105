"""The one TOML config shared by ``train``, ``simulate``, ``coordinator``, ``worker`` and ``audit``.

Every section is a frozen pydantic model that forbids unknown keys, so a typo is an error, not a
silently ignored setting; values are strict (``true``/``false`` only for booleans, unquoted numbers
for numbers: ``"yes"``, ``1`` or ``"80"`` are errors naming the key, never coerced).
:func:`load_config` turns validation failures into :class:`ConfigError`
whose message names the key, the bad value and the allowed range, e.g.
``privacy.delta must be in (0, 1), got 1.5``; an unknown key gets the closest known one. The
files a config names are checked by :mod:`userdp.local_files`.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, ValidationError

from userdp.local_files import local_file_problems


class ConfigError(ValueError):
    """The config file is missing, not TOML, or fails validation (one line per problem)."""


def _interval(lo: float, hi: float, lo_open: bool = True, hi_open: bool = True):
    """A validator for a real number in an interval; its message states the interval."""
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    shown_hi = "inf" if math.isinf(hi) else f"{hi:g}"
    text = f"{left}{lo:g}, {shown_hi}{right}"

    def check(value: float) -> float:
        ok_lo = value > lo if lo_open else value >= lo
        ok_hi = value < hi if hi_open else value <= hi
        if not (ok_lo and ok_hi) or math.isnan(value):
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
        if value < lo:
            raise ValueError(f"must be an integer >= {lo}, got {value}")
        return value

    return AfterValidator(check)


PositiveInt = Annotated[int, _at_least(1)]
NonNegativeInt = Annotated[int, _at_least(0)]


class _Section(BaseModel):
    """Strict: a TOML string is never read as a number (``steps = "80"`` is an error)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


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
    """How a user's examples are chosen each step (the selection strategies of "Mind the Privacy
    Unit! User-Level Differential Privacy for Language Model Fine-Tuning", §4.1, §5.1).
    ``highest_ppl`` / ``lowest_ppl`` rank them by perplexity under the initial model, which each
    worker computes once at start (docs/data.md); user-level strategies only."""
    seq_len: PositiveInt = 128
    """Maximum tokens per example fed to the model: at most the model's positions (a preset's
    position table is built for it, up to ``PRESET_MAX_SEQ_LEN``)."""


ZERO3_REFUSAL = (
    "ZeRO-3 is not supported: it keeps only a partition of each parameter on a rank outside a "
    "module's forward/backward, while the clipping engines read whole parameters (shapes, "
    "per-unit norms) and a worker applies the coordinator's broadcast to whole tensors; neither "
    "is implemented for partitioned parameters (docs/worker.md). Use stage 0-2"
)


PARTITIONING = ("tensor_parallel", "sequence_parallel_size", "pipeline", "moe", "expert_parallel")
"""Keys that split a module's parameters or tokens across a worker's ranks: a rank would then
see only part of a unit's gradient (its norm) or of its tokens, so they are refused."""


def deepspeed_json_problem(config: Any) -> str | None:
    """Why a DeepSpeed config object cannot drive a userdp worker (None when it can)."""
    if not isinstance(config, dict):
        return "must hold a JSON object (DeepSpeed's config format)"
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2):
        return f"sets zero_optimization.stage = {stage!r}; {ZERO3_REFUSAL}"
    for key in PARTITIONING:
        value = config.get(key)
        if value not in (None, {}, False, 0, 1):
            return (
                f"sets {key!r}: it splits a module's parameters or tokens across the worker's "
                "ranks, so no rank sees a unit's whole gradient to clip it; remove it"
            )
    return None


def read_deepspeed_json(path: str | None) -> dict[str, Any] | None:
    """``model.deepspeed_config``'s JSON object (None when unset); ValueError naming the file and
    what is wrong when it is unreadable or cannot drive a userdp worker."""
    if not path:
        return None
    try:
        loaded = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"model.deepspeed_config = {path!r} is not a file (a DeepSpeed JSON config)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"model.deepspeed_config = {path!r} is not a readable JSON file: {exc}"
        ) from None
    problem = deepspeed_json_problem(loaded)
    if problem:
        raise ValueError(f"model.deepspeed_config = {path!r} {problem}")
    return loaded


def _zero_stage(value: int) -> int:
    if value == 3:
        raise ValueError(f"= 3: {ZERO3_REFUSAL}")
    if value not in (0, 1, 2):
        raise ValueError(f"must be 0, 1 or 2, got {value!r}")
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
    """DeepSpeed ZeRO stage on workers (0-2); a ``deepspeed_config`` file's stage wins."""
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


BUILTIN_STRATEGIES: tuple[str, ...] = (
    "uls",
    "els",
    "group-privacy",
    "dp-fedavg",
    "adaptive-clipping",
    "randomized-clipping",
    "blt-dp-ftrl",
    "user-wise-filter",
)
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
    """None = 1 / N^1.1 with N the number of training users."""
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
    """0 = pick a free port (simulate); a deployment sets a fixed one."""
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


class WorkersConfig(_Section):
    count: PositiveInt = 2
    replicas: PositiveInt = 1
    """How many workers hold each shard; > 1 lets a step finish when a worker dies."""
    device: Literal["cpu", "cuda"] = "cpu"
    token_budget: PositiveInt = 8192
    """Tokens per micro-batch; bounds worker memory."""
    tensor_core_matmul: StrictBool = False
    """Vectorized engines, bf16 models on CUDA only: run the per-unit norm and book-keeping
    products as bf16 GEMMs on the tensor cores (about 1.6x faster end to end on an H100) instead
    of IEEE float32 GEMMs. Tensor-core float32 accumulation is not IEEE: it under-estimated a
    squared norm by 2.3e-4 relative over 50257 terms on an H100, so every norm is inflated by
    0.1% (clipping slightly harder) to cover it. That margin is measured, not proven: keep the
    default (false) where the clip bound must hold to float32 rounding (docs/worker.md)."""
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
    ``userdp[wandb]``); see userdp/tracking.py for where each writes."""
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


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys of the config section at ``loc`` (a validation error's location, minus its
    last part)."""
    model: Any = Config
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None or not isinstance(field.annotation, type):
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def _format_error(err: dict[str, Any]) -> str:
    key = ".".join(str(part) for part in err["loc"])
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(str(err["loc"][-1]), _known_keys(err["loc"][:-1]), n=1)
        hint = f"did you mean {close[0]!r}? " if close else "check the spelling; "
        return f"{key}: unknown key ({hint}see `userdp config show` for all keys)"
    if kind == "missing":
        return f"{key}: required key is missing"
    if kind == "bool_type":
        return f"{key} must be true or false (an unquoted TOML boolean), got {value!r}"
    if kind in ("int_type", "float_type") and isinstance(value, str):
        what = "an integer" if kind == "int_type" else "a number"
        return f"{key} must be {what}, not a string: write it unquoted, got {value!r}"
    if kind == "int_type":
        return f"{key} must be an integer, got {value!r}"
    if kind == "float_type":
        return f"{key} must be a number, got {value!r}"
    message = err["msg"]
    if message.startswith("Value error, "):
        return f"{key} {message.removeprefix('Value error, ')}"
    return f"{key}: {message[0].lower() + message[1:]}, got {value!r}"


def parse_config(raw: dict[str, Any]) -> Config:
    """Validate a parsed TOML document; raise ConfigError naming every bad key."""
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        lines = [_format_error(err) for err in exc.errors()]
        raise ConfigError("; ".join(lines)) from None
    strategy = config.strategy
    if strategy.name in BUILTIN_STRATEGIES and (strategy.params or strategy.plugin_path):
        key = "params" if strategy.params else "plugin_path"
        raise ConfigError(
            f"strategy.{key} is for plugin strategies (name = 'package.module:ClassName'); the "
            f"built-in {strategy.name!r} takes the [strategy] keys"
        )
    from userdp.clients.selection import PERPLEXITY_SELECTIONS

    if config.data.selection in PERPLEXITY_SELECTIONS and strategy.name in ("els", "group-privacy"):
        raise ConfigError(
            f"data.selection = {config.data.selection!r} ranks a user's examples for user-level "
            f"units, but strategy.name = {strategy.name!r} trains on example units of a subset "
            "the coordinator draws uniformly; use a user-level strategy (uls, dp-fedavg, ...) or "
            "data.selection = 'random'"
        )
    _check_user_wise_filter(strategy)
    _check_normalizers(strategy)
    if config.model.path is None:
        _check_preset_seq_len(config.model.preset, config.data.seq_len)
    workers = config.workers
    if workers.replicas > workers.count:
        raise ConfigError(
            f"workers.replicas = {workers.replicas} > workers.count = {workers.count}: each shard "
            "needs that many distinct workers; lower workers.replicas or raise workers.count"
        )
    cyclic = strategy.sampling == "cyclic-poisson"
    if cyclic != (strategy.bands is not None) or (cyclic and strategy.name != "blt-dp-ftrl"):
        raise ConfigError(
            "strategy.sampling = 'cyclic-poisson' and strategy.bands go together, with "
            "strategy.name = 'blt-dp-ftrl' (banded C, accounted as banded matrix factorization "
            f"with cyclic Poisson sampling); got name {strategy.name!r}, sampling "
            f"{strategy.sampling!r}, bands {strategy.bands!r}"
        )
    if config.strategy.sampling == "shuffle" and not config.privacy.allow_unaccounted_sampling:
        raise ConfigError(
            "strategy.sampling = 'shuffle' has no tight accountant: set "
            "privacy.allow_unaccounted_sampling = true to run it anyway (the report will say so)"
        )
    return config


PRESET_MAX_SEQ_LEN = 8192
"""The longest ``data.seq_len`` a preset is built for (its position table has that many rows)."""


def _check_preset_seq_len(preset: str | None, seq_len: int) -> None:
    """A preset sizes its positions from ``data.seq_len``: bound it, with the memory it implies."""
    if seq_len <= PRESET_MAX_SEQ_LEN:
        return
    from userdp.clients.model import PRESETS

    family, layers, width, heads = PRESETS[preset or "gpt2-tiny"]
    table = (
        f"a position table of {seq_len:,} x {width} float32 ({seq_len * width * 4 / 1e9:.3g} GB)"
    )
    scores = heads * seq_len**2 * 4 / 1e9
    raise ConfigError(
        f"data.seq_len = {seq_len:,} is more than {PRESET_MAX_SEQ_LEN}, the longest the presets "
        f"are built for: model.preset = {preset!r} would get "
        + (f"{table} and " if family == "gpt2" else "")
        + f"attention scores of {heads} heads x {seq_len:,}² float32 per layer and example "
        f"({scores:.3g} GB); set data.seq_len <= {PRESET_MAX_SEQ_LEN}"
    )


USER_LEVEL_NORMALIZED = (
    "uls",
    "dp-fedavg",
    "adaptive-clipping",
    "randomized-clipping",
    "blt-dp-ftrl",
)
"""Built-ins whose noisy sum is divided by an expected cohort of users."""


def _check_normalizers(strategy: StrategyConfig) -> None:
    """``expected_cohort_size`` / ``expected_batch_size`` only where the strategy uses them."""
    for key, names in (
        ("expected_cohort_size", USER_LEVEL_NORMALIZED),
        ("expected_batch_size", ("els", "group-privacy")),
    ):
        if getattr(strategy, key) is not None and strategy.name not in names:
            raise ConfigError(
                f"strategy.{key} applies to strategy.name in {names}, not {strategy.name!r}: "
                + (
                    "a plugin takes its arguments in [strategy.params]"
                    if strategy.name not in BUILTIN_STRATEGIES
                    else "remove it"
                )
            )


def _check_user_wise_filter(strategy: StrategyConfig) -> None:
    """``user-wise-filter`` takes every user in every step and needs τ; τ means nothing elsewhere."""
    name = strategy.name
    if name != "user-wise-filter":
        if strategy.concentration_threshold is not None:
            raise ConfigError(
                "strategy.concentration_threshold is for strategy.name = 'user-wise-filter'; "
                f"remove it for {name!r}"
            )
        return
    if strategy.concentration_threshold is None:
        raise ConfigError(
            "strategy.name = 'user-wise-filter' needs strategy.concentration_threshold (tau, the "
            "L2 radius of concentrated user gradients; the noise scales with it)"
        )
    if strategy.sampling != "poisson" or strategy.sampling_prob != 1.0:
        raise ConfigError(
            "strategy.name = 'user-wise-filter' uses every user in every step: set "
            "strategy.sampling = 'poisson' and strategy.sampling_prob = 1.0, got "
            f"{strategy.sampling!r} with {strategy.sampling_prob:g}"
        )


def check_local_files(config: Config) -> None:
    """The files ``config`` names on THIS machine (:mod:`userdp.local_files`), its DeepSpeed JSON
    and its plugin; :class:`ConfigError` naming every problem. Checked by :func:`load_config`,
    not by :func:`parse_config` nor ``deploy render``, whose config names paths that exist only
    inside the pods."""
    problems = local_file_problems(config)
    if config.model.deepspeed_config is not None:
        try:
            read_deepspeed_json(config.model.deepspeed_config)
        except ValueError as exc:
            problems.append(str(exc))
    if config.strategy.name not in BUILTIN_STRATEGIES:
        from userdp.plugins import check_plugin

        try:
            check_plugin(config)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("; ".join(problems))


def load_config(path: str | Path, *, local_files: bool = True) -> Config:
    """Read and validate a TOML config file, and (``local_files``) the files it names on this
    machine (:func:`check_local_files`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None
    config = parse_config(raw)
    strategy = config.strategy
    if strategy.name not in BUILTIN_STRATEGIES:
        folder = Path(strategy.plugin_path or ".").expanduser()
        folder = folder if folder.is_absolute() else path.resolve().parent / folder
        config = config.model_copy(
            update={"strategy": strategy.model_copy(update={"plugin_path": str(folder)})}
        )
    if local_files:
        check_local_files(config)
    return config
