"""Every setting cosyserve reads, declared once, and the one :class:`Settings` object built from them.

Each field of :class:`Settings` is declared with :func:`setting`: its environment variable, its CLI flag (or
none), its ``[pool]`` key in the pool config file (or none), its parser (type, range or choices), its default and
a one-line doc. :meth:`Settings.load` reads them once, at start, with the precedence flag > environment > pool
config file > default, and checks every value: a bad one raises :class:`~cosyserve.core.errors.SettingsError` naming
where it came from as the user typed it (``--port 99999``, ``COSYSERVE_PORT='99999'``,
``pool.toml: [pool] lru_k = 0``) and what is accepted. The object is then passed down explicitly (CLI ->
:func:`cosyserve.load`, the server, the pool builder; inherited by ``--workers`` processes); nothing below the entry
points reads the environment. docs/settings.md's tables are generated from these declarations
(``scripts/settings_tables.py``; a test checks they are current).

Model follows uvicorn's ``Config`` (one object, cheap ``__init__``, loaded once) and starlette's
``Config(key, cast, default)`` (one typed getter that raises on a bad value).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosyserve.core.casts import (
    LEVELS,
    NAME,
    ApiKeys,
    Bool,
    Choice,
    Device,
    Float,
    Folder,
    Int,
    ListenUri,
    LogLevel,
    Models,
    Name,
    Origins,
    Size,
    Text,
    parse_api_keys,
)
from cosyserve.core.errors import SettingsError

__all__ = [
    "CHUNK_POLICY_CHOICES",
    "DEMO_MODEL",
    "FIRST_HOP_DEFAULT",
    "FIRST_HOP_RANGE",
    "ModelArg",
    "PoolFile",
    "Setting",
    "Settings",
    "SettingsError",
    "declared",
    "parse_model_arg",
    "parse_setting",
    "read_pool_file",
    "torch_installed",
]

# what ``--model demo`` names: a tiny random-weight model generated once into the cache
# (:func:`cosyserve.bundle.sources.demo_model_dir`)
DEMO_MODEL = "demo"

# the streaming chunk policies (cosyserve.families.cosyvoice.streampolicy.StreamPolicy.named) and the first hop's
# range in tokens: below 12 (at 50 tokens/s) the first window cannot fill the vocoder's cache; above 200 it exceeds the
# longest hop
CHUNK_POLICY_CHOICES = ("reference", "low-latency")
FIRST_HOP_RANGE = (12, 200)
# 21: the shortest first hop whose window (41 tokens) is longer than twice the overlap, so the flow's length
# regulator maps the overlap tokens onto exactly the mel frames that are cross-faded with the next window (from 12
# to 20 they are interpolated with the rest: the seam frames are only approximately the same tokens). Streamed vs
# one-shot distances measured no better or worse from 15 to 25 on random weights (cosyserve.tools.quality), and
# each token less is one LLM step (~40-60 ms on 2 cores) sooner.
FIRST_HOP_DEFAULT = 21


def torch_installed() -> bool:
    """Whether torch is installed, found without importing it (a millisecond, not the second its import takes):
    what the ``runtime`` setting defaults by."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # ValueError: a module object in sys.modules without a spec
        return False


# -- declarations -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting: where it is read from, how it is parsed, its default and what it means.

    Args:
        name: the :class:`Settings` attribute.
        env: its environment variable (None: none).
        flag: its CLI flag (None: none).
        key: its ``[pool]`` key in the pool config file (None: none).
        cast: raw value -> value, raising ValueError that says what is accepted (:mod:`cosyserve.core.casts`).
        default: the value when nothing sets it (see ``factory``).
        doc: one line: what it means.
        group: which table of docs/settings.md lists it (``cli``, ``serve``, ``pool``, ``load``; None: none).
        shown: how docs/settings.md and ``--help`` show the default (None: the default itself).
        factory: computes the default from the environment instead (the cache dir follows XDG_CACHE_HOME).
        blank_unsets: a blank environment value means unset (False: it is an error).
        secret: errors do not repeat the value.
    """

    name: str
    env: str | None
    flag: str | None
    key: str | None
    cast: Callable[[Any], Any]
    default: Any
    doc: str
    group: str | None
    shown: str | None = None
    factory: Callable[[Mapping[str, str]], Any] | None = None
    blank_unsets: bool = True
    secret: bool = False

    def default_for(self, env: Mapping[str, str]) -> Any:
        return self.factory(env) if self.factory is not None else self.default

    def shown_default(self) -> str:
        if self.shown is not None:
            return self.shown
        d = self.default
        if d is None or d == () or d == {}:
            return "none"
        if isinstance(d, bool):
            return "true" if d else "false"
        return f"{d:g}" if isinstance(d, float) else str(d)


def setting(
    default: Any,
    *,
    cast: Callable[[Any], Any],
    doc: str,
    group: str | None,
    env: str | None = None,
    flag: str | None = None,
    key: str | None = None,
    shown: str | None = None,
    factory: Callable[[Mapping[str, str]], Any] | None = None,
    blank_unsets: bool = True,
    secret: bool = False,
) -> Any:
    """A :class:`Settings` field declared as a setting (the field's name is the setting's name)."""
    meta = dict(
        env=env,
        flag=flag,
        key=key,
        cast=cast,
        default=default,
        doc=doc,
        group=group,
        shown=shown,
        factory=factory,
        blank_unsets=blank_unsets,
        secret=secret,
    )
    # a secret stays out of repr(), hence out of logs and tracebacks
    if isinstance(default, dict):
        return field(default_factory=dict, repr=not secret, metadata={"setting": meta})
    if factory is not None:
        return field(default_factory=lambda: factory(os.environ), repr=not secret, metadata={"setting": meta})
    return field(default=default, repr=not secret, metadata={"setting": meta})


_cli = functools.partial(setting, group="cli")
_loading = functools.partial(setting, group="load")
_serve = functools.partial(setting, group="serve")
_pool = functools.partial(setting, group="pool")
_internal = functools.partial(setting, group=None)


def _dtype_setting(component: str, doc: str) -> Any:
    # a component's compute dtype: None keeps the bundle's
    return _loading(
        None,
        env=f"COSYSERVE_{component.upper()}_DTYPE",
        flag=f"--{component}-dtype",
        cast=Choice("float32", "bfloat16", "float16"),
        doc=doc,
        shown="as stored",
    )


def _cache_dir(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cosyserve"


def _default_runtime(env: Mapping[str, str]) -> str:
    return "torch" if torch_installed() else "lite"


@dataclass(frozen=True)
class ModelArg:
    """One ``--model``: served as ``name``, from ``source`` (bundle, official dir or hub id)."""

    name: str
    source: str


@dataclass(frozen=True)
class PoolFile:
    """The pool config file as read by :meth:`Settings.load`: its ``[pool]`` values become settings; its
    ``[models.NAME]`` and ``[tenants.NAME]`` tables are read by :func:`cosyserve.engine.poolfile.load_pool_config`.

    Args:
        source: the path as given (errors name it so).
        base: the folder relative model paths start from.
        pool: the ``[pool]`` table.
        models: the ``[models]`` table.
        tenants: the ``[tenants]`` table.
    """

    source: str
    base: Path
    pool: dict[str, Any]
    models: dict[str, Any]
    tenants: dict[str, Any]


@dataclass(frozen=True)
class Settings:
    """Everything cosyserve runs with; build it with :meth:`load` (once, at start) and pass it down.

    ``Settings()`` holds the defaults (the cache dir's follows ``XDG_CACHE_HOME``, as every program's does). Every
    field is a declared setting (see :func:`declared`) except
    ``pool_file`` (the pool config file's tables, read by :meth:`load`) and ``origins`` (where each value came
    from, for error messages and for rules that depend on it).
    """

    # -- the command line --------------------------------------------------------------------------------------
    models: tuple[str, ...] = _cli(
        (),
        env="COSYSERVE_MODEL",
        flag="--model",
        cast=Models(),
        doc="the model: a bundle, an official model dir or a hub id; `serve` takes `[NAME=]PATH` and repeats it",
        shown="none (`serve`: the demo model)",
    )
    log_level: str = _cli(
        "warning",
        env="COSYSERVE_LOG_LEVEL",
        flag="--log-level",
        cast=LogLevel(),
        doc="logging level of the command",
    )
    omp_wait_policy: str = _cli(
        "passive",
        env="COSYSERVE_OMP_WAIT_POLICY",
        cast=Choice("passive", "active", "unset"),
        doc="how torch's OpenMP threads wait between parallel regions in cosyserve's commands and servers (their "
        "`OMP_WAIT_POLICY`, set before torch loads; an `OMP_WAIT_POLICY` in the environment wins): `passive` "
        "sleeps (a CPU shared with other busy processes stays fast), `active` spins, `unset` leaves libgomp's "
        "default (spin a while, then sleep); figures: bench/omp_wait.py",
    )
    # -- loading a model (every command, the server and cosyserve.load) ----------------------------------------
    runtime: str = _loading(
        "torch",
        env="COSYSERVE_RUNTIME",
        flag="--runtime",
        cast=Choice("torch", "lite"),
        factory=_default_runtime,
        shown="torch (lite where torch is not installed)",
        doc="what runs the model: `torch` (our PyTorch modules; every model and mode) or `lite` (ONNX Runtime and "
        "numpy, no torch in the process: a bundle converted with `convert --runtime lite`; CosyVoice-300M, every "
        "mode)",
    )
    device: str = _loading(
        "cpu",
        env="COSYSERVE_DEVICE",
        flag="--device",
        key="device",
        cast=Device(),
        doc="where the torch runtime computes: `cpu`, `cuda` (the first GPU) or `cuda:N`; a machine or a torch "
        "build without CUDA stops the start with one line; the lite runtime runs on the CPU only",
    )
    strategy: str = _loading(
        "preload",
        env="COSYSERVE_PRELOAD",
        flag="--strategy",
        cast=Choice("preload", "lazy", "prefetch", booleans=("preload", "lazy")),
        doc="`preload` (map every weight page before READY; embedding tables are only read into the page cache "
        "and fault in by row, so the unused rows of the 51866-token text vocabulary, 212 MB fp32, cost no RSS), "
        "`lazy` (pages fault in on use), `prefetch` (lazy, then mapped in the background after READY); or a "
        "boolean (true = preload)",
    )
    warmup: bool = _loading(
        True,
        env="PREWARM_MODELS",
        cast=Bool({"all": True, "none": False}),
        doc="warm-up on dummy inputs: only the LLM before READY; the flow and the vocoder right after it, in the "
        "background (timed as `warmup_token2wav`; a request reaches them seconds later); the lite runtime maps its "
        "LLM step weights in instead of running it (boolean, `all`, `none`)",
    )
    warmup_tokens: int = _loading(
        2,
        env="COSYSERVE_WARMUP_TOKENS",
        cast=Int(1),
        doc="the warm-up's length in speech tokens (it runs one layer of each stack on dummy inputs)",
    )
    use_mmap: bool = _loading(
        True,
        env="USE_MMAP_LOADING",
        cast=Bool(),
        doc="map the bundle (true) or copy the weights into private memory (false)",
    )
    verify: str = _loading(
        "stamp",
        env="COSYSERVE_VERIFY",
        cast=Choice("stamp", "full", "none"),
        doc="checksums: `stamp` (hash each file once per version), `full` (every start), `none`",
    )
    threads: int | None = _loading(
        None,
        env="COSYSERVE_THREADS",
        flag="--threads",
        cast=Int(1),
        doc="torch CPU threads",
        shown="torch's default",
    )
    text_tier: str = _loading(
        "background",
        env="COSYSERVE_TEXT_TIER",
        cast=Choice("background", "lazy"),
        doc="the text tokenizer and wetext's normalisers (~0.3 s): `background` (built after READY; timed as "
        "`text_tier`; a request that comes sooner waits for them) or `lazy` (first request)",
    )
    zero_shot_tier: str = _loading(
        "lazy",
        env="COSYSERVE_ZERO_SHOT_TIER",
        cast=Choice("lazy", "background"),
        doc="ONNX sessions of the zero-shot tier: `lazy` (first request that needs them) or `background` (after "
        "READY; timed as the `zero_shot_tier` phase)",
    )
    chunk_policy: str = _loading(
        "low-latency",
        env="COSYSERVE_CHUNK_POLICY",
        cast=Choice(*CHUNK_POLICY_CHOICES),
        doc="streaming chunks: `low-latency` (a first hop of `first_hop_tokens`, doubling per chunk up to 4 s) "
        "or `reference` (the reference's constant 2 s hop: the first audio needs 120 speech tokens)",
    )
    first_hop_tokens: int = _loading(
        FIRST_HOP_DEFAULT,
        env="COSYSERVE_FIRST_HOP_TOKENS",
        cast=Int(*FIRST_HOP_RANGE),
        doc="the low-latency policy's first hop in speech tokens (50/s); the first audio needs it + 20 overlap "
        "tokens",
    )
    cache_dir: Path = _loading(
        None,
        env="COSYSERVE_CACHE_DIR",
        cast=Folder(),
        factory=_cache_dir,
        doc="where official model dirs are converted to bundles (and the demo model is made)",
        shown="~/.cache/cosyserve ($XDG_CACHE_HOME/cosyserve)",
    )
    registry_dir: Path | None = _loading(
        None,
        env="COSYSERVE_REGISTRY_DIR",
        flag="--registry-dir",
        cast=Folder(),
        blank_unsets=False,
        doc="registered (zero-shot) voices, shared by every model of a family (CosyVoice2 and CosyVoice3 models "
        "use its `cosyvoice2/` and `cosyvoice3/` folders); set it in deployments: caches get wiped",
        shown="cache dir/speakers/MODEL",
    )
    # -- precision and flow steps (cosyserve.models.precision) ------------------------------------------------
    llm_dtype: str | None = _dtype_setting(
        "llm",
        "the LLM's compute dtype; a dtype other than the bundle's casts at load into private memory (the "
        "LLM's bytes in the new dtype, on top of the mapped file's page cache)",
    )
    flow_dtype: str | None = _dtype_setting(
        "flow",
        "the flow's compute dtype (cast as `llm_dtype` is); bfloat16 pays only on CPUs with native bf16 "
        "(AMX, AVX512-BF16): 8x slower than float32 on AVX2",
    )
    hift_dtype: str | None = _dtype_setting(
        "hift",
        "the vocoder's compute dtype (cast as `llm_dtype` is); its f0 predictor, source and iSTFT stay float32; "
        "bfloat16 pays only on CPUs with native bf16",
    )
    llm_quantize: str = _loading(
        "none",
        env="COSYSERVE_LLM_QUANTIZE",
        flag="--llm-quantize",
        cast=Choice("none", "int8"),
        doc="`int8`: the LLM's transformer and speech-head linears as weight-only int8 (quantized at load, "
        "private memory of a quarter of their fp32 bytes, unless the bundle stores them so: `convert --quantize "
        "llm=int8`); `none`: as stored",
    )
    llm_gemm: str = _loading(
        "auto",
        env="COSYSERVE_LLM_GEMM",
        flag="--llm-gemm",
        cast=Choice("auto", "linear", "transposed", "packed"),
        doc="how the LLM's float32 decode steps multiply on CPU: `auto` times `x·Wᵀ` (torch's linear) against "
        "`W·xᵀ` on the first steps of each batch size and keeps the faster (up to 1.7x faster steps on an AMD "
        "EPYC), and once a step serves several requests also makes oneDNN-blocked copies of the weights (where "
        "memory holds twice their size: 1.4 GB for CosyVoice2/3) and times them too (batched steps up to 2.3x "
        "faster on that EPYC); `linear` or `transposed` fixes one, so that runs repeat to the last bit; `packed` "
        "makes the blocked copies at load (~2 s of start) and multiplies every step and prefill with them; on the "
        "lite runtime `packed` prepacks the LM's batch graph after READY (batched steps ~2x faster on that EPYC; "
        "the weights' size again in memory), `auto` does so at the first moment with no request in flight after a "
        "batched step (where memory holds twice that), and `linear` and `transposed` change nothing",
    )
    flow_steps: int | None = _loading(
        None,
        env="COSYSERVE_FLOW_STEPS",
        flag="--flow-steps",
        cast=Int(1, 1000),
        doc="Euler steps of the flow (fewer: faster, further from the model's output)",
        shown="the model's (10)",
    )
    flow_context_seconds: float = _loading(
        0.0,
        env="COSYSERVE_FLOW_CONTEXT_SECONDS",
        flag="--flow-context-seconds",
        cast=Float(0, 600),
        doc="opt-in: a streamed CosyVoice2/3 request's flow attends to its prompt and only the most recent this "
        "many seconds of its speech (whole 1 s attention chunks), so that each chunk costs the same and its state "
        "stops growing (about 230 MB per second of window in float32 for CosyVoice2), and its last chunk is "
        "computed chunk-causally through the same state instead of the reference's full-attention pass; audio "
        "beyond the window is no longer the reference's (a lite CosyVoice2 bundle converted before lite took it "
        "ignores it); 0: every frame, the reference's result",
    )
    voice_cache_mb: int = _loading(
        4096,
        env="COSYSERVE_VOICE_CACHE_MB",
        flag="--voice-cache-mb",
        cast=Int(0, 1 << 24),
        doc="memory for the flow states of registered voices and recent prompts (CosyVoice2/3 streaming: what "
        "depends on the voice sample alone, computed once), least recently used out; about 230 MB per second of "
        "sample for a CosyVoice2 flow in float32, 180 MB for CosyVoice3; also the LM's prompt prefixes (its keys "
        "and values of sos, speaker and prompt text, kept by a voice's first request: about 1 MB for a 12 s "
        "CosyVoice2 voice in float32); 0 keeps none",
    )
    stream_state_mb: int = _loading(
        8192,
        env="COSYSERVE_STREAM_STATE_MB",
        flag="--stream-state-mb",
        cast=Int(0, 1 << 24),
        doc="the most memory one streamed CosyVoice2/3 request's flow state may hold (it grows with the "
        "utterance: about 230 MB per second of speech for CosyVoice2 in float32, 180 MB for CosyVoice3, so that "
        "each chunk costs its own frames); past it the request's next chunks re-run the flow on everything so far, "
        "as the reference does; 0: no bound",
    )
    stream_state_budget_mb: int | None = _loading(
        None,
        env="COSYSERVE_STREAM_STATE_BUDGET_MB",
        flag="--stream-state-budget-mb",
        cast=Int(0, 1 << 24),
        doc="the most memory the streamed CosyVoice2/3 requests' flow states of one loaded model may hold "
        "together (each bounded by `stream_state_mb` too); a stream whose next chunk would pass it continues as "
        "past its own bound (it is not refused: its audio has started and its length is unknown in advance); "
        "each instance of a model has its own; 0: no bound",
        shown="a quarter of the memory limit (cgroup or RAM), divided among the --workers",
    )
    voice_cache_disk: bool = _loading(
        False,
        env="COSYSERVE_VOICE_CACHE_DISK",
        cast=Bool(),
        doc="also store registered voices' flow states beside the registry (its `.flow-states/`, as large as in "
        "memory) for later starts to map, instead of computing them at first use",
    )
    # -- the server ----------------------------------------------------------------------------------------------
    host: str = _serve(
        "127.0.0.1",
        env="COSYSERVE_HOST",
        flag="--host",
        cast=Text(),
        doc="address to listen on",
    )
    port: int = _serve(
        8000,
        env="COSYSERVE_PORT",
        flag="--port",
        cast=Int(0, 65535),
        doc="port",
    )
    workers: int = _serve(
        1,
        env="COSYSERVE_WORKERS",
        flag="--workers",
        cast=Int(1, 64),
        doc="worker processes (Linux): forked from one process that loaded the preload models, sharing its memory",
    )
    worker_ready_timeout_s: float = _serve(
        120.0,
        env="COSYSERVE_WORKER_READY_TIMEOUT",
        flag="--worker-ready-timeout",
        cast=Float(1, 3600),
        doc="with --workers: seconds a forked worker may take to get READY before the master kills and "
        "replaces it",
    )
    pool_config: str | None = _serve(
        None,
        env="COSYSERVE_POOL_CONFIG",
        flag="--config",
        cast=Text(),
        doc="pool config file (TOML: models, tenants, memory budget); `--model` adds preload models to it",
    )
    api_keys_file: str | None = _serve(
        None,
        env="COSYSERVE_API_KEYS_FILE",
        flag="--api-keys-file",
        cast=Text(),
        doc="file of `KEY=TENANT` lines (`#` comments); with keys, requests need `Authorization: Bearer KEY`",
        shown="no auth",
    )
    api_keys: dict[str, str] = _serve(
        {},
        env="COSYSERVE_API_KEYS",
        cast=ApiKeys(),
        secret=True,
        doc="`KEY=TENANT,KEY2=TENANT2`, added to the keys file's",
        shown="no auth",
    )
    cors_origins: tuple[str, ...] = _serve(
        (),
        env="COSYSERVE_CORS_ORIGINS",
        flag="--cors-origins",
        cast=Origins(),
        doc="comma-separated origins allowed by CORS (`*` for any)",
        shown="CORS off",
    )
    # -- the limits of a request (cosyserve.core.limits applies them all, on every route, the Python API and the CLI) --
    max_text_chars: int = _serve(
        4096,
        env="COSYSERVE_MAX_TEXT_CHARS",
        flag="--max-text-chars",
        cast=Int(1, 1_000_000),
        doc="longest text to speak (`input`, `tts_text`, `--text`), and longest piece of streamed text "
        "(a WebSocket `input.text`)",
    )
    max_buffered_text_chars: int = _serve(
        4096,
        env="COSYSERVE_MAX_BUFFERED_TEXT_CHARS",
        flag="--max-buffered-text-chars",
        cast=Int(1, 1_000_000),
        doc="streamed text an utterance holds received and not yet read by the model: past it the server reads "
        "no more from the client (TCP holds it back) until the model catches up",
    )
    max_prompt_text_chars: int = _serve(
        1024,
        env="COSYSERVE_MAX_PROMPT_TEXT_CHARS",
        flag="--max-prompt-text-chars",
        cast=Int(1, 1_000_000),
        doc="longest transcript of a voice sample (`ref_text`, `prompt_text`)",
    )
    max_instructions_chars: int = _serve(
        1024,
        env="COSYSERVE_MAX_INSTRUCTIONS_CHARS",
        flag="--max-instructions-chars",
        cast=Int(1, 1_000_000),
        doc="longest style instruction (`instructions`, `instruct_text`)",
    )
    max_voice_name_chars: int = _serve(
        256,
        env="COSYSERVE_MAX_VOICE_NAME_CHARS",
        flag="--max-voice-name-chars",
        cast=Int(1, 4096),
        doc="longest voice name a request gives (`voice`, `spk_id`, `--speaker`)",
    )
    max_upload_bytes: int = _serve(
        16 << 20,
        env="COSYSERVE_MAX_UPLOAD_BYTES",
        flag="--max-upload-bytes",
        cast=Int(1024, 1 << 30),
        doc="largest voice sample or recording to convert (`ref_audio`, `prompt_wav`, `audio_sample`, "
        "`source_wav`)",
        shown="16777216 (16 MiB)",
    )
    max_prompt_seconds: float = _serve(
        30.0,
        env="COSYSERVE_MAX_PROMPT_SECONDS",
        flag="--max-prompt-seconds",
        cast=Float(0.5, 30),
        doc="longest voice sample or recording to convert, in seconds (the reference's speech tokenizer takes "
        "at most 30)",
    )
    max_body_bytes: int = _internal(
        1 << 20,
        cast=Int(1024, 1 << 30),
        doc="largest JSON request body",
    )
    request_timeout_s: float = _serve(
        300.0,
        env="COSYSERVE_REQUEST_TIMEOUT",
        flag="--request-timeout",
        cast=Float(0.1, 86400),
        doc="seconds a request may take before it is stopped",
    )
    body_timeout_s: float = _serve(
        10.0,
        env="COSYSERVE_BODY_TIMEOUT",
        cast=Float(0.1, 3600),
        doc="seconds a request body may pause (nothing of it arriving) before the request gets 408 and its "
        "connection is closed; a whole body has --request-timeout",
    )
    max_pending_bodies: int = _serve(
        64,
        env="COSYSERVE_MAX_PENDING_BODIES",
        cast=Int(1, 1 << 20),
        doc="requests that may be part way through sending their body at once (per worker); one more gets 503 "
        "at once",
    )
    ws_idle_timeout_s: float = _serve(
        30.0,
        env="COSYSERVE_WS_IDLE_TIMEOUT",
        cast=Float(0.1, 86400),
        doc="seconds a WebSocket session or a Wyoming connection waits on its client (its next message, or taking "
        "the audio sent) before it is closed and its work freed",
    )
    drain_delay_s: float = _serve(
        5.0,
        env="COSYSERVE_DRAIN_DELAY",
        flag="--drain-delay",
        cast=Float(0, 3600),
        doc="seconds the port stays open after SIGTERM, answering 503 so load balancers see the drain, before "
        "it closes",
    )
    shutdown_grace_s: float = _serve(
        30.0,
        env="COSYSERVE_SHUTDOWN_GRACE",
        flag="--shutdown-grace",
        cast=Float(0, 3600),
        doc="seconds in-flight requests get to finish once the port closes; then they are cut",
    )
    default_voice: str | None = _serve(
        None,
        env="COSYSERVE_DEFAULT_VOICE",
        flag="--default-voice",
        cast=Text(exact=True),
        doc="the voice of requests that name none, and of OpenAI's alloy (the other OpenAI voice names go round the "
        "model's other speakers)",
        shown="first speaker",
    )
    # -- Wyoming (Home Assistant): cosyserve.server.transports.wyoming -------------------------------------------
    wyoming_uri: str | None = _serve(
        None,
        env="COSYSERVE_WYOMING_URI",
        flag="--wyoming-uri",
        cast=ListenUri(),
        doc="also serve the Wyoming protocol (Home Assistant) here, beside HTTP: `tcp://HOST:PORT` (Home "
        "Assistant's convention: port 10200) or `unix://PATH`; needs `pip install 'cosyserve[wyoming]'`",
        shown="off",
    )
    wyoming_tenant: str | None = _serve(
        None,
        env="COSYSERVE_WYOMING_TENANT",
        flag="--wyoming-tenant",
        cast=Name(),
        doc="the tenant a Wyoming caller acts as (Wyoming has no API keys: anyone who reaches the port): its "
        "models, registered voices and quota; required with API keys",
        shown="no tenant (as HTTP without keys)",
    )
    wyoming_zeroconf: str | None = _serve(
        None,
        env="COSYSERVE_WYOMING_ZEROCONF",
        flag="--wyoming-zeroconf",
        cast=Text(),
        doc="announce the Wyoming server on the local network (zeroconf/mDNS, `_wyoming._tcp`) under this name, "
        "so Home Assistant discovers it (a `tcp://` URI only)",
        shown="off",
    )
    serve_log_level: str = _serve(
        "info",
        env="COSYSERVE_SERVE_LOG_LEVEL",
        flag="--serve-log-level",
        cast=LogLevel(*LEVELS),
        doc="the server's log level",
    )
    # -- the model pool (also [pool] keys of the pool config file) ----------------------------------------------
    memory_budget: int | str | None = _pool(
        None,
        env="COSYSERVE_MEMORY_BUDGET",
        key="memory_budget",
        cast=Size(),
        doc='memory the loaded models may take: bytes (an integer, "4GiB", "512MB") or a percentage of the '
        'memory limit ("75%")',
        shown="no budget",
    )
    pressure_threshold: float = _pool(
        0.8,
        env="COSYSERVE_MEMORY_PRESSURE",
        key="pressure_threshold",
        cast=Float(0, 1, open_lo=True),
        doc="evict idle models when memory in use / limit goes above this, in (0, 1]",
    )
    lru_k: int = _pool(
        2,
        env="COSYSERVE_LRU_K",
        key="lru_k",
        cast=Int(1),
        doc="eviction order: LRU-K over the last K uses",
    )
    instances: int = _pool(
        1,
        env="MODEL_POOL_SIZE",
        key="instances",
        cast=Int(1),
        doc="prewarmed instances per model (the variable also wins over a model's own `instances`)",
    )
    batch_size: int | None = _pool(
        None,
        env="COSYSERVE_BATCH_SIZE",
        key="batch_size",
        cast=Int(1),
        doc="requests served at once per instance, LM decode steps batched across them (the variable also wins "
        "over a model's own `batch_size`); unset: the family's, 8 for CosyVoice2/3, 4 for CosyVoice-300M",
        shown="8 (CosyVoice2/3), 4 (300M)",
    )
    queue_limit: int = _pool(
        16,
        env="COSYSERVE_QUEUE_LIMIT",
        key="queue_limit",
        cast=Int(0),
        doc="requests waiting per model before 503",
    )
    idle_ttl_s: float | None = _pool(
        None,
        env="COSYSERVE_IDLE_TTL",
        key="idle_ttl_s",
        cast=Float(0, open_lo=True),
        doc="release a model idle this many seconds",
        shown="never",
    )
    torch_threads: int | None = _pool(
        None,
        env="COSYSERVE_WORKER_THREADS",
        key="torch_threads",
        cast=Int(1),
        doc="torch threads per request; unset: the process's threads shared among the requests running at once "
        "(all of them for a request alone, one each when as many run as there are cores)",
        shown="shared",
    )
    housekeeping_interval_s: float = _pool(
        1.0,
        key="housekeeping_interval_s",
        cast=Float(0, open_lo=True),
        doc="how often TTL and memory pressure are checked (seconds)",
    )
    release_timeout_s: float = _pool(
        30.0,
        key="release_timeout_s",
        cast=Float(0, open_lo=True),
        doc="how long an evicted model's in-flight requests may take (seconds)",
    )

    pool_file: PoolFile | None = None
    origins: dict[str, tuple[str, str]] = field(default_factory=dict, compare=False, repr=False)

    # -- building ------------------------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        *,
        flags: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        file: str | Path | None = None,
    ) -> Settings:
        """Read every setting once: flag > environment > pool config file > default, each value checked.

        Args:
            flags: parsed CLI flags by setting name (``{"port": "8001"}``); None values count as not given.
            env: the environment (default ``os.environ``).
            file: the pool config file whose ``[pool]`` values to read (default: the one ``pool_config`` names).
        Returns:
            The :class:`Settings`.
        Raises:
            SettingsError: a bad value, named as it was given (flag, variable, or file and key), with what is
                accepted; an unreadable or malformed pool config file.
            TypeError: ``flags`` names something that is not a setting (a bug in the caller).
        """
        env = os.environ if env is None else env
        flags = {k: v for k, v in (flags or {}).items() if v is not None}
        unknown = sorted(set(flags) - set(_DECLARED))
        if unknown:
            raise TypeError(f"not a setting: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        origins: dict[str, tuple[str, str]] = {}

        def read(s: Setting, pool: Mapping[str, Any]) -> None:
            if s.name in flags:
                raw, kind, label = flags[s.name], "flag", s.flag or s.name
            elif s.env is not None and s.env in env and (env[s.env].strip() or not s.blank_unsets):
                raw, kind, label = env[s.env], "env", s.env
            elif s.key is not None and s.key in pool:
                raw, kind, label = pool[s.key], "file", f"{pool_source}: [pool] {s.key}"
            else:
                values[s.name] = s.default_for(env)
                origins[s.name] = ("default", "the default")
                return
            values[s.name] = parse_setting(s.name, raw, _where(s, kind, label, raw))
            origins[s.name] = (kind, label)

        pool_source = ""
        read(_DECLARED["pool_config"], {})
        if file is not None:
            values["pool_config"] = str(file)
            origins["pool_config"] = ("override", "Settings.load(file=...)")
        pool_file = read_pool_file(values["pool_config"]) if values["pool_config"] is not None else None
        if pool_file is not None:
            pool_source = pool_file.source
        for s in _DECLARED.values():
            if s.name != "pool_config":
                read(s, pool_file.pool if pool_file is not None else {})
        values["api_keys"] = _merge_key_file(values, origins)
        return cls(**values, pool_file=pool_file, origins=origins)

    def replace(self, *, where: str = "Settings.replace", **values: Any) -> Settings:
        """A copy with ``values`` (by setting name; None values are ignored), each checked.

        Args:
            where: who gives them, for error messages (``cosyserve.load`` gives ``cosyserve.load(strategy='x')``).
            values: setting name -> raw value.
        Returns:
            The new :class:`Settings`.
        Raises:
            SettingsError: a bad value. TypeError: a name that is not a setting, or a file setting (the file is
                read by :meth:`load` only).
        """
        given = {k: v for k, v in values.items() if v is not None}
        unknown = sorted(set(given) - (set(_DECLARED) - {"pool_config", "api_keys_file"}))
        if unknown:
            raise TypeError(f"{where}: not a setting that can be replaced: {', '.join(unknown)}")
        parsed = {
            k: parse_setting(k, v, f"{where}({k}={'...' if _DECLARED[k].secret else repr(v)})")
            for k, v in given.items()
        }
        origins = {**self.origins, **{k: ("override", where) for k in parsed}}
        return dataclasses.replace(self, **parsed, origins=origins)

    # -- reading -------------------------------------------------------------------------------------------------

    def origin(self, name: str) -> str:
        """Where setting ``name`` came from: ``flag``, ``env``, ``file``, ``override`` or ``default``."""
        return self.origins.get(name, ("default", ""))[0]

    def where(self, name: str) -> str:
        """How setting ``name`` was given, for messages: ``--port``, ``COSYSERVE_PORT``, ``pool.toml: [pool] lru_k``."""
        s = _DECLARED[name]
        kind, label = self.origins.get(name, ("default", ""))
        if kind == "default":
            return s.flag or s.env or name
        return label

    @property
    def demo(self) -> bool:
        """No model and no pool config: the server serves the tiny random-weight demo model."""
        return not self.models and self.pool_config is None

    def model_args(self) -> tuple[ModelArg, ...]:
        """``models`` as the server takes them (``[NAME=]SOURCE``), names checked and unique.

        Raises:
            SettingsError: a bad or repeated name, named with the flag or variable that gave it.
        """
        where = self.where("models")
        args = tuple(parse_model_arg(m, where) for m in self.models)
        names = [m.name for m in args]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SettingsError(f"{where}: name {dup[0]!r} given twice; use NAME=PATH to rename one")
        return args


def _where(s: Setting, kind: str, label: str, raw: Any) -> str:
    if kind == "file":
        return f"{label} = {raw!r}"
    if s.secret:
        return label
    if kind == "env":
        return f"{label}={raw!r}"
    if isinstance(raw, list | tuple):
        return label
    return f"{label} {raw}" if label.startswith("-") else f"{label}={raw!r}"


def _merge_key_file(values: dict[str, Any], origins: Mapping[str, tuple[str, str]]) -> dict[str, str]:
    path = values["api_keys_file"]
    keys: dict[str, str] = {}
    if path is not None:
        where = origins["api_keys_file"][1]
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise SettingsError(f"{where}: cannot read API keys file {path}: {e}") from e
        keys.update(parse_api_keys(text, f"{where} {path}"))
    keys.update(values["api_keys"])
    return keys


def declared() -> tuple[Setting, ...]:
    """Every declared setting, in declaration order."""
    return tuple(_DECLARED.values())


def parse_setting(name: str, raw: Any, where: str) -> Any:
    """Parse ``raw`` as setting ``name``.

    Args:
        name: the setting (a :class:`Settings` attribute).
        raw: the value as given.
        where: how it was given, as the user typed it (``--port 99999``); starts the error message.
    Returns:
        The parsed value.
    Raises:
        SettingsError: ``"{where}: {what is accepted}"``.
    """
    try:
        return _DECLARED[name].cast(raw)
    except ValueError as e:
        raise SettingsError(f"{where}: {e}") from None


def _declarations() -> dict[str, Setting]:
    out = {}
    for f in dataclasses.fields(Settings):
        if "setting" in f.metadata:
            out[f.name] = Setting(name=f.name, **f.metadata["setting"])
    return out


_DECLARED = _declarations()


# -- the pool config file -------------------------------------------------------------------------------------

_TOP_KEYS = ("pool", "models", "tenants")


def read_pool_file(path: str | Path) -> PoolFile:
    """Read a pool config file (TOML) and check its top level and ``[pool]`` keys.

    Args:
        path: the file; relative model paths in it start from its folder.
    Returns:
        A :class:`PoolFile` (its values not checked yet: :meth:`Settings.load` and the pool-file reader do that).
    Raises:
        SettingsError: the file is missing, unreadable, not TOML, or has an unknown table or ``[pool]`` key.
    """
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SettingsError(f"pool config file not found: {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsError(f"cannot read pool config {p}: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"{p}: not valid TOML: {e}") from e
    source = str(path)
    unknown = sorted(set(raw) - set(_TOP_KEYS))
    if unknown:
        raise SettingsError(
            f"{source}: top level: unknown key {unknown[0]!r}; expected one of {', '.join(_TOP_KEYS)}"
        )
    tables = {}
    for name in _TOP_KEYS:
        t = raw.get(name, {})
        if not isinstance(t, dict):
            raise SettingsError(f"{source}: [{name}]: expected a table, got {t!r}")
        tables[name] = t
    keys = sorted(s.key for s in _DECLARED.values() if s.key is not None)
    unknown = sorted(set(tables["pool"]) - set(keys))
    if unknown:
        raise SettingsError(
            f"{source}: [pool]: unknown key {unknown[0]!r}; expected one of {', '.join(keys)}"
        )
    return PoolFile(source, p.resolve().parent, tables["pool"], tables["models"], tables["tenants"])


# -- --model and API keys ---------------------------------------------------------------------------------------


def parse_model_arg(value: str, where: str = "--model") -> ModelArg:
    """``PATH``, ``HUB/ID`` or ``NAME=SOURCE``; the name defaults to the last path component.

    Args:
        value: what was given.
        where: the flag or variable that gave it, for errors.
    Returns:
        The :class:`ModelArg`.
    Raises:
        SettingsError: an empty value or source, or a name that is not 1-64 letters, digits, '.', '_' or '-'.
    """
    value = value.strip()
    if not value:
        raise SettingsError(f"{where}: empty value; give a bundle, a model dir or NAME=PATH")
    name, sep, source = value.partition("=")
    if not sep:
        source = value
        name = Path(value.rstrip("/")).name or value
    name, source = name.strip(), source.strip()
    if not NAME.match(name):
        raise SettingsError(
            f"{where}={value!r}: model name {name!r} must be 1-64 letters, digits, '.', '_' or '-'"
        )
    if not source:
        raise SettingsError(f"{where}={value!r}: no path after '='")
    return ModelArg(name, source)
