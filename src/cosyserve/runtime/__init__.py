"""The one interface between a loaded model and everything that serves it.

The engine, the pool, the server and the Python API talk to a model only through :class:`Runtime`; they never
import a runtime's module, read its private members or sniff its features. A runtime is named by an import string
(:data:`RUNTIMES`, as uvicorn names its loops and protocols) and imported only when :func:`load_runtime` asks for
it, so importing one never imports another: the torch runtime (our PyTorch modules) is the one today.

A runtime is built already loaded (``load_runtime`` returns once it can serve) and serves ``slots`` requests at
once from as many threads; :meth:`Runtime.start` runs in the thread that will iterate its audio.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from cosyserve.core.settings import CHUNK_POLICY_CHOICES, FIRST_HOP_DEFAULT, FIRST_HOP_RANGE

if TYPE_CHECKING:
    import numpy as np

    from cosyserve.core.clock import PhaseClock
    from cosyserve.core.request import Mode, SynthesisRequest

__all__ = [
    "PIECE_SECONDS_MAX",
    "RUNTIMES",
    "Runtime",
    "RuntimeOptions",
    "Voice",
    "load_runtime",
    "runtime_factory",
]

# runtime name -> "module:factory"; the factory is ``(path, options, clock) -> Runtime``
RUNTIMES: dict[str, str] = {
    "torch": "cosyserve.runtime.pytorch:load",
    "lite": "cosyserve.runtime.lite:load",
}


# The longest speech one piece of text may make, in seconds. A piece (a sentence, or a bounded part of a long one:
# cosyserve.frontend.text.PIECE_MAX_N) is one LM run and, without streaming, one flow and one vocoder pass; the
# reference caps its LM at 20 speech tokens per text token (64 s for a piece of 160 tokens at 50 Hz, 128 s at
# 25 Hz), and a model that never draws its stop token (random weights, or text it cannot read) runs to that cap.
# This bounds the work and memory of one pass and of one LM run, and is far above the speech of any piece read at a
# normal pace (160 tokens are about 120 English words: 48 s at 150 words a minute).
PIECE_SECONDS_MAX = 60


@dataclass(frozen=True)
class Voice:
    """A voice a request can name as its ``speaker``.

    Attributes:
        name: the id requests use.
        kind: ``pre-defined`` (the model's spk2info) or ``registered`` (added with ``add_voice``).
        mode: the mode it speaks in when a request names no mode: ``sft`` for an embedding, ``zero_shot`` for a
            registered prompt.
    """

    name: str
    kind: Literal["pre-defined", "registered"]
    mode: Mode


@dataclass(frozen=True)
class RuntimeOptions:
    """How a runtime loads and serves; every field has a setting (see :mod:`cosyserve.core.settings`).

    Args:
        strategy: ``preload`` (map and touch every weight page before READY), ``lazy`` or ``prefetch``.
        verify: bundle checksum policy ``stamp`` / ``full`` / ``none``.
        use_mmap: map the weights (True) or copy them into private memory.
        warmup: run each component once on dummy inputs (the LM before READY, the rest right after; the lite
            runtime maps its LM step graph's weights in before READY instead, where the kernel can).
        warmup_tokens: speech tokens the warm-up generates.
        threads: intra-op threads of the process (None: the library's default).
        worker_threads: intra-op threads of each thread that runs requests (None: the process's threads shared
            among the requests running at once, see :mod:`cosyserve.runtime.cores`).
        batch_size: requests served at once, their LM steps batched in the model's one decode loop (its rows); 1
            serves one at a time (None: the family's, :attr:`cosyserve.families.base.Family.batch_size`: 8 for
            CosyVoice2/3, 4 for CosyVoice-300M).
        batch_flow: with ``batch_size`` > 1, also stack concurrent flow and vocoder calls of equal shapes (the
            parts the family stacks: CosyVoice-300M's flow and vocoder, CosyVoice2's and CosyVoice3's vocoders and
            streamed flow chunks).
        text_tier: the text normalisers and tokenizer: ``background`` (built after READY) or ``lazy``.
        zero_shot_tier: the prompt modes' ONNX sessions: ``lazy`` (first request) or ``background``.
        registry_dir: where registered voices live (None: the cache dir, per model).
        cache_dir: where official model dirs are converted to bundles, and the demo model lives (None: the
            ``cache_dir`` setting of the environment).
        default_voice: the speaker of requests that name none (None: the model's first pre-defined speaker).
        chunk_policy: streaming chunks: ``low-latency`` (a first hop of ``first_hop`` tokens, doubling per chunk
            up to 4 s) or ``reference`` (the reference's constant 2 s hop; what conformance checks).
        first_hop: the low-latency policy's first hop in speech tokens (its first audio needs ``first_hop`` + 20
            overlap tokens).
        llm_dtype, flow_dtype, hift_dtype: compute dtype of each component, ``float32``, ``bfloat16`` or
            ``float16`` (None: as the bundle stores it); a cast makes private copies of the cast weights.
        llm_quantize: ``int8`` (the LLM's transformer and speech-head linears as weight-only int8, quantized in
            memory when the bundle holds float weights) or ``none`` (as stored).
        llm_gemm: the float32 LLM's decode products on CPU (:mod:`cosyserve.models.gemm`): ``auto`` (timed on the
            first steps of each row count), ``linear`` (``x·Wᵀ``), ``transposed`` (``W·xᵀ``) or ``packed`` (oneDNN-blocked
            copies of the weights, made at load).
        flow_steps: the flow's Euler steps, >= 1 (None: the model's own count, 10 for CosyVoice-300M).
        flow_context_seconds: seconds of generated speech a streamed CosyVoice2/3 request's flow attends to beyond
            its prompt, so that a chunk's cost and its state's memory stop growing (the last call then chunk-causal
            too); 0: every frame, the reference's result. Both runtimes' incremental flows (lite: a CosyVoice2
            bundle converted before its encoder graph took ``ahead`` ignores it with a warning).
        voice_cache_mb: memory for voices' precomputed flow states (CosyVoice2/3 streaming,
            :mod:`cosyserve.voices.voicestates`) and LM prompt prefixes (:class:`cosyserve.runtime.lm.Prefix`); 0
            keeps none.
        voice_cache_disk: also store registered voices' flow states beside the registry.
        stream_state_mb: the most one streamed request's flow state may hold; past it, the request's next chunks
            re-run the flow on everything so far (0: no bound).
        stream_state_budget_mb: the most every streamed request's flow state of the model may hold together; a
            stream whose next chunk would pass it goes on as past ``stream_state_mb`` (None: a quarter of the
            memory this process may use, see :meth:`stream_state_budget`; 0: no bound).
        stream_state_shares: the processes that share that default quarter (the server's ``workers``: each forked
            worker loads its own models).
        fork_template: load in a prefork template that will be forked without exec: start no thread (native
            ones included) and leave none running when the load returns; the work a runtime would do in the
            background after READY is done before it returns or, when it would start threads (ONNX sessions),
            waits for :meth:`Runtime.after_fork`, which each forked child calls.
        device: where the torch runtime computes, ``cpu``, ``cuda`` or ``cuda:N`` (the name only is checked here;
            :func:`cosyserve.system.device.resolve_device` checks the machine has it). The lite runtime refuses any but
            ``cpu``.
    """

    strategy: Literal["preload", "lazy", "prefetch"] = "preload"
    verify: Literal["stamp", "full", "none"] = "stamp"
    use_mmap: bool = True
    warmup: bool = True
    warmup_tokens: int = 2
    threads: int | None = None
    worker_threads: int | None = None
    batch_size: int | None = None
    batch_flow: bool = False
    chunk_policy: Literal["reference", "low-latency"] = "low-latency"
    first_hop: int = FIRST_HOP_DEFAULT
    text_tier: Literal["background", "lazy"] = "background"
    zero_shot_tier: Literal["lazy", "background"] = "lazy"
    registry_dir: str | None = None
    cache_dir: str | None = None
    default_voice: str | None = None
    # -- precision and flow steps (cosyserve.models.precision) --
    llm_dtype: str | None = None
    flow_dtype: str | None = None
    hift_dtype: str | None = None
    llm_quantize: Literal["none", "int8"] = "none"
    llm_gemm: Literal["auto", "linear", "transposed", "packed"] = "auto"
    flow_steps: int | None = None
    flow_context_seconds: float = 0.0
    voice_cache_mb: int = 4096
    voice_cache_disk: bool = False
    stream_state_mb: int = 8192
    stream_state_budget_mb: int | None = None
    stream_state_shares: int = 1
    fork_template: bool = False
    device: str = "cpu"

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> RuntimeOptions:
        """The options a :class:`cosyserve.core.settings.Settings` asks for; ``overrides`` (fields) win."""
        s = settings
        options = cls(
            strategy=s.strategy,
            verify=s.verify,
            use_mmap=s.use_mmap,
            warmup=s.warmup,
            warmup_tokens=s.warmup_tokens,
            threads=s.threads,
            text_tier=s.text_tier,
            zero_shot_tier=s.zero_shot_tier,
            chunk_policy=s.chunk_policy,
            first_hop=s.first_hop_tokens,
            registry_dir=str(s.registry_dir) if s.registry_dir is not None else None,
            cache_dir=str(s.cache_dir),
            default_voice=s.default_voice,
            llm_dtype=s.llm_dtype,
            flow_dtype=s.flow_dtype,
            hift_dtype=s.hift_dtype,
            llm_quantize=s.llm_quantize,
            llm_gemm=s.llm_gemm,
            flow_steps=s.flow_steps,
            flow_context_seconds=s.flow_context_seconds,
            voice_cache_mb=s.voice_cache_mb,
            voice_cache_disk=s.voice_cache_disk,
            stream_state_mb=s.stream_state_mb,
            stream_state_budget_mb=s.stream_state_budget_mb,
            stream_state_shares=s.workers,
            device=s.device,
        )
        return dataclasses.replace(options, **overrides) if overrides else options

    def for_family(self, family: Any) -> RuntimeOptions:
        """These options with what they leave to the model's family filled in (``batch_size``)."""
        if self.batch_size is None:
            return dataclasses.replace(self, batch_size=family.batch_size)
        return self

    def __post_init__(self) -> None:
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.warmup_tokens < 1:
            raise ValueError(f"warmup_tokens must be >= 1, got {self.warmup_tokens}")
        if self.chunk_policy not in CHUNK_POLICY_CHOICES:
            raise ValueError(
                f"chunk_policy must be one of {', '.join(CHUNK_POLICY_CHOICES)}, got {self.chunk_policy!r}"
            )
        lo, hi = FIRST_HOP_RANGE
        if (
            isinstance(self.first_hop, bool)
            or not isinstance(self.first_hop, int)
            or not lo <= self.first_hop <= hi
        ):
            raise ValueError(
                f"first_hop must be an integer between {lo} and {hi} tokens, got {self.first_hop!r}"
            )
        for name in ("llm_dtype", "flow_dtype", "hift_dtype"):
            value = getattr(self, name)
            if value is not None and value not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{name} must be float32, bfloat16, float16 or None, got {value!r}")
        if self.llm_quantize not in ("none", "int8"):
            raise ValueError(f"llm_quantize must be none or int8, got {self.llm_quantize!r}")
        if self.llm_gemm not in ("auto", "linear", "transposed", "packed"):
            raise ValueError(f"llm_gemm must be auto, linear, transposed or packed, got {self.llm_gemm!r}")
        if self.flow_steps is not None and (isinstance(self.flow_steps, bool) or self.flow_steps < 1):
            raise ValueError(f"flow_steps must be an integer >= 1 or None, got {self.flow_steps!r}")
        context = self.flow_context_seconds
        if isinstance(context, bool) or not isinstance(context, int | float) or not 0 <= context <= 600:
            raise ValueError(f"flow_context_seconds must be a number between 0 and 600, got {context!r}")
        shares = self.stream_state_shares
        if isinstance(shares, bool) or not isinstance(shares, int) or shares < 1:
            raise ValueError(f"stream_state_shares must be an integer >= 1, got {self.stream_state_shares!r}")
        for name in ("voice_cache_mb", "stream_state_mb", "stream_state_budget_mb"):
            value = getattr(self, name)
            if value is None and name == "stream_state_budget_mb":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not _is_device_name(self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N (N >= 0), got {self.device!r}")

    def stream_state_budget(self) -> int | None:
        """The bytes of ``stream_state_budget_mb`` (None: no bound). Unset, a quarter of the memory this process may
        use (its cgroup's limit, or the machine's RAM), divided among ``stream_state_shares`` worker processes:
        the model's weights, its voice cache (``voice_cache_mb``), the LM's caches and the other models of a pool
        share the rest; a quarter of 24 GiB keeps about 27 s of CosyVoice2 speech (fp32) in the streams' states
        together. Each loaded instance of a model has its own bound."""
        if self.stream_state_budget_mb is None:
            from cosyserve.system.pagecache import memory_limit_bytes

            return memory_limit_bytes() // 4 // self.stream_state_shares
        return (self.stream_state_budget_mb << 20) or None


def _is_device_name(value: object) -> bool:
    from cosyserve.core.casts import Device

    try:
        return isinstance(value, str) and Device()(value) == value
    except ValueError:
        return False


@runtime_checkable
class Runtime(Protocol):
    """A loaded model that synthesizes (see the module docstring).

    Attributes:
        sample_rate: Hz of the audio it yields.
        slots: requests it serves at once (each from its own thread).
        clock: its start clock: the phases of its load, and its points (``ready``) since process start.
        precision: component (``llm``, ``flow``, ``hift``) -> the dtype it computes in, and why when not as
            stored (chosen at load for the CPU or GPU; the startup report shows it).
        registry_root: the folder its registered voices live in (None: it keeps no registry); what is kept
            beside them (the consent ledger of ``/v1/audio/voices``) lives there too.
    """

    sample_rate: int
    slots: int
    clock: PhaseClock
    precision: dict[str, str]

    @property
    def registry_root(self) -> Path | None: ...

    def speakers(self) -> list[str]:
        """The model's pre-defined speaker ids, sorted."""
        ...

    def voices(self, tenant: str = "default") -> list[Voice]:
        """The pre-defined speakers, then the voices registered for ``tenant``."""
        ...

    def voice(self, name: str, tenant: str = "default") -> Voice | None:
        """The voice ``name`` for ``tenant`` (None when it has none of that name)."""
        ...

    def languages(self) -> list[str]:
        """The languages its voices speak (its family's, BCP 47 primary tags), the model's main one first."""
        ...

    def modes(self) -> dict[Mode, str | None]:
        """Every mode -> None where it is served, else why not (a missing file, not an -Instruct model)."""
        ...

    def resolve(self, request: SynthesisRequest) -> SynthesisRequest:
        """``request`` as this model runs it: ``mode`` decided (None: by the voice) and ``speaker`` filled in (None
        in sft/instruct: the default voice). Raises what the model cannot serve (UnknownVoiceError,
        ModeUnavailableError) without reading any audio: the engine asks it when a request is admitted."""
        ...

    def start(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> Iterator[np.ndarray]:
        """Check ``request`` against the model and prepare it now (its errors raise here, before any audio),
        then return a generator of float32 mono chunks (1-D, at ``sample_rate``).

        ``should_stop`` is asked after every speech token; once it says True the generator ends at once. Closing
        the generator frees its state.
        """
        ...

    def warm_up(self) -> None:
        """Run every component once on dummy inputs (idempotent; safe while requests run)."""
        ...

    def mapped_files(self) -> list[Path]:
        """The files whose pages it maps (for RSS accounting and page-cache control)."""
        ...

    def mapped_bytes(self) -> int:
        """Bytes of weights it holds (its share of a memory budget)."""
        ...

    def add_voice(
        self,
        name: str,
        prompt_wav: Any,
        prompt_text: str,
        *,
        tenant: str = "default",
        overwrite: bool = False,
    ) -> Any:
        """Register ``prompt_wav`` + its transcript as voice ``name`` of ``tenant`` (kept across restarts)."""
        ...

    def remove_voice(self, name: str, *, tenant: str = "default") -> None:
        """Delete a registered voice."""
        ...

    def import_voices(self, path: str | Path, *, tenant: str = "default", overwrite: bool = False) -> Any:
        """Register the entries of a reference ``spk2info.pt``."""
        ...

    def export_voices(
        self, path: str | Path, *, tenant: str = "default", include_builtin: bool = False
    ) -> list[str]:
        """Write ``tenant``'s registered voices (and the pre-defined ones) as a reference ``spk2info.pt``."""
        ...

    def join_background(self, timeout: float | None = None) -> None:
        """Wait for the work it runs after READY (text tier, warm-up, zero-shot tier); each part up to ``timeout``
        seconds (None: until done). What a measurement that must see a settled process calls."""
        ...

    def after_fork(self) -> None:
        """In a child forked from the process that loaded it with ``fork_template``: take up the process's
        threads and start what waited for the fork (called once per child, before it serves)."""
        ...

    def on_lm_step(self, record: Callable[[int], None]) -> None:
        """Call ``record(rows)`` after every decode step of its LM, with the rows the step decoded together (the
        engine counts them in its model's stats: ``cosyserve_lm_batch_rows``)."""
        ...

    def close(self) -> None:
        """Stop its threads and drop its references to the weights (the runtime is unusable afterwards)."""
        ...


def runtime_factory(name: str) -> Callable[..., Runtime]:
    """The factory :data:`RUNTIMES` names for ``name`` (imports its module now)."""
    try:
        target = RUNTIMES[name]
    except KeyError:
        from cosyserve.core.errors import SettingsError

        raise SettingsError(f"unknown runtime {name!r}; expected one of {', '.join(RUNTIMES)}") from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def load_runtime(
    path: str | Path, options: RuntimeOptions | None = None, *, runtime: str = "torch", clock: Any = None
) -> Runtime:
    """Load the model at ``path`` (a bundle, an official model dir, a hub id or ``demo``) into runtime ``runtime``.

    Args:
        path: what to load (see :func:`cosyserve.api.resolve_bundle`).
        options: how to load and serve it (default :class:`RuntimeOptions`).
        runtime: a key of :data:`RUNTIMES`.
        clock: a :class:`cosyserve.core.clock.PhaseClock` to record the load's phases in (default a new one that
            counts from process start).
    Returns:
        The loaded :class:`Runtime`, READY to serve.
    """
    return runtime_factory(runtime)(path, options or RuntimeOptions(), clock)
