"""The lite runtime's models: ONNX Runtime sessions over a bundle's ``lite/`` graphs, driven by numpy.

:class:`LiteBundle` checks a bundle's ``lite/`` files and opens their sessions; the LMs are in
:mod:`cosyserve.runtime.lite.lm`. :class:`LiteFlow` turns tokens into mel (encoder graph, the length regulator's
interpolation, the Euler loop over the estimator graph) and :class:`LiteVocoder` turns mel into audio (f0 graph,
the sine source, STFT, the decoder graph, iSTFT), each with the torch module's call and shapes: the family's
:class:`~cosyserve.families.cosyvoice.token2wav.Token2Wav` streams over them as over the torch modules. Sessions
are thread-safe: requests share them and own only their caches and random generators. Nothing here imports torch.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from cosyserve.bundle.lite import (
    BATCH_STEP,
    INT8_STEP,
    LITE_DIR,
    LITE_FORMAT,
    LITE_PARTS,
    LITE_VERSION,
    LITE_VERSIONS,
    TABLES_FILE,
)
from cosyserve.bundle.safetensors_np import map_safetensors
from cosyserve.core.errors import BundleError
from cosyserve.core.sampling import ArrayOps
from cosyserve.core.stop import ShouldStop, check
from cosyserve.models import lite_dsp as dsp
from cosyserve.runtime.cores import Running
from cosyserve.runtime.lite import terminate

__all__ = ["LiteBundle", "LiteFlow", "LiteVocoder", "session_options"]

OVERLAP_TOKENS = 20  # the length regulator interpolates a chunk's first and last 20 tokens apart
CACHE_TAIL_FRAMES = 34  # flow cache frames kept after the prompt (the torch flow's)


def mel_length(num_tokens: int, input_frame_rate: int) -> int:
    return int(num_tokens / input_frame_rate * 22050 / 256)


def session_options(
    threads: int | None, *, prepack: bool = False, optimize: bool = True, plan_reuse: bool = True
) -> Any:
    """ORT session options for a fast start: no weight prepacking (a session then opens in milliseconds over
    mapped weights; prepacking copies and reorders every weight, ~0.8 s per GB), ``threads`` intra-op threads;
    ``optimize`` False turns ORT's graph rewrites off (the LM graphs: the full set costs ~90 ms more to open
    the step graph and decodes no faster, measured on the full-size model); ``plan_reuse`` False skips the
    allocation planner's buffer-reuse analysis, which grows faster than the graph (the full-size Qwen LM step's
    1540 nodes: 340-370 ms of CPU to open with it, 43-55 ms without; its steps and peak RSS the same: the arena
    reuses freed blocks anyway)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_mem_reuse = plan_reuse
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    return so


class CountedRuns:
    """An ORT session whose runs in flight are counted (``run``, ``run_with_iobinding``; everything else is the
    session's), so that its successor can wait for none: a quick session's, see :meth:`LiteBundle.upgrade`."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.runs = Running()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(self.session.run, args, kwargs)

    def run_with_iobinding(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(self.session.run_with_iobinding, args, kwargs)

    def _counted(self, call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.runs.enter()
        try:
            return call(*args, **kwargs)
        finally:
            self.runs.leave()


class LiteBundle:
    """A bundle's ``lite/`` folder: its manifest checked, each file's size checked, its sessions opened.

    Args:
        path: the bundle directory.
        verify: ``full`` (hash every lite file), ``stamp`` (hash a file once per version, as the torch loader
            does), ``none`` (sizes only).
        threads: intra-op threads of each session.
        prepack: prepack the LM graphs' weights too (the flow's and vocoder's always are).
        prepack_batch: prepack the LM's batch graph only (``llm_gemm=packed``: its steps of several rows ~2x
            cheaper on a Zen 4 EPYC; the open takes ~1.2 s at full size and the weights' size again in memory, so
            the lite runtime opens it after READY between requests, or a first batched step does).
        int8: serve the int8 LM step graph.
        bundle: the opened :class:`cosyserve.bundle.loader.Bundle` (default: opened here), whose file check and
            stamps the lite files share.
    """

    def __init__(
        self,
        path: Path,
        verify: str = "stamp",
        threads: int | None = None,
        prepack: bool = False,
        int8: bool = False,
        bundle: Any = None,
        prepack_batch: bool = False,
    ):
        self.path = Path(path)
        self.dir = self.path / LITE_DIR
        where = self.dir / "manifest.json"
        try:
            self.manifest = json.loads(where.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise BundleError(
                f"{self.path} has no lite runtime graphs ({LITE_DIR}/manifest.json): convert the model with "
                "`cosyserve convert MODEL_DIR BUNDLE --runtime lite` on a machine with torch"
            ) from None
        except (OSError, ValueError) as e:
            raise BundleError(
                f"{where}: unreadable ({e}); convert the model again with --runtime lite"
            ) from e
        if not isinstance(self.manifest, dict):
            raise BundleError(f"{where}: not a JSON object; convert the model again with --runtime lite")
        version, config = self.manifest.get("version"), self.manifest.get("config")
        flow = config.get("flow") if isinstance(config, dict) else None
        # version 3 changed CosyVoice2's flow graphs only (its encoder's stream state): a version 2 CosyVoice2 bundle,
        # whose flow_mu_stream keeps none (mu_lead None), is converted again; the others are read as they are
        stale = version == 2 and isinstance(flow, dict) and "mu_lead" in flow and flow["mu_lead"] is None
        if self.manifest.get("format") != LITE_FORMAT or version not in LITE_VERSIONS or stale:
            raise BundleError(
                f"{where}: format {self.manifest.get('format')!r} version {self.manifest.get('version')!r}, "
                f"this cosyserve reads {LITE_FORMAT!r} version {LITE_VERSION}: convert again with --runtime lite"
            )
        config = self.manifest.get("config")
        # a bundle written before the parts were recorded holds all of them
        self.parts: list[str] = list(self.manifest.get("parts", LITE_PARTS))
        graphs = self.manifest.get("graphs")
        if (
            not isinstance(config, dict)
            or not {"sample_rate", *self.parts} <= set(config)
            or not isinstance(graphs, dict)
            or not all(isinstance(v, str) and "/" not in v for v in graphs.values())
        ):
            raise BundleError(
                f"{where}: no complete config in it; convert the model again with --runtime lite"
            )
        self.config: dict[str, Any] = config
        self.graphs: dict[str, str] = graphs
        self.int8 = int8
        if int8 and INT8_STEP not in self.manifest.get("files", {}):
            raise BundleError(
                f"{self.path} has no int8 LM graph: convert the model with `cosyserve convert MODEL_DIR BUNDLE "
                "--runtime lite --quantize llm=int8`, or serve it with llm_quantize=none"
            )
        self._check_files(verify, bundle)
        self.threads = threads
        self.prepack = prepack
        self.prepack_batch = prepack_batch
        self.sessions: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _check_files(self, verify: str, bundle: Any) -> None:
        # the bundle's own check (size always, sha256 per the policy, stamps in the bundle's stamp file)
        if bundle is None:
            from cosyserve.bundle.loader import open_bundle

            bundle = open_bundle(self.path)
        bundle.verify = verify
        for name, entry in self.manifest.get("files", {}).items():
            bundle.check_file(
                f"{LITE_DIR}/{name}", entry, again="convert the model again with --runtime lite"
            )

    def session(self, name: str) -> Any:
        """The ORT session of graph ``name`` (opened once, on first use, in its serving form; or the quick form
        that :meth:`open_quick` opened, until :meth:`upgrade` replaces it)."""
        s = self.sessions.get(name)
        if s is None:
            with self._lock:
                s = self.sessions.get(name)
                if s is None:
                    s = self.sessions[name] = self._open(name, quick=False)
        return s

    def open_quick(self, name: str) -> bool:
        """Open graph ``name`` now in a quick form (no prepacking; a flow or vocoder graph without rewrites either)
        where its serving form prepacks its weights, and serve it so until :meth:`upgrade`; returns whether it
        did (False: the serving form opens as fast, or was open already, and is open now). Why: READY waits for
        the LM's step graph (int8 prepacked: 0.36 s at full size on a 2-core Xeon, 0.05 s not; its steps 2.3x
        slower until the upgrade), and a first request for the sessions opened after READY (ORT holds the GIL
        while one opens: the full-size estimator 2.3 s, 0.25 s quick; its runs ~1.4x slower until the upgrade)."""
        int8 = self.int8 and name == "llm_step"
        if not (int8 or self.prepack or not name.startswith("llm_")):
            self.session(name)
            return False
        with self._lock:
            if name in self.sessions:
                return False
            self.sessions[name] = CountedRuns(self._open(name, quick=True))
        return True

    def upgrade(self, name: str, wait_s: float = 120.0) -> None:
        """Replace graph ``name``'s quick session by its serving form. Every run asks :meth:`session` for its
        session, so one that asks meanwhile waits for the new one; a run in flight on the quick one is waited for
        (``wait_s`` at most) before the serving form opens: its open reads every mapped weight to prepack it, and
        the quick form's weights, which a run in flight keeps mapped and resident, held 1.3 GB more at the peak
        (full-size CosyVoice3: 4.9 GB instead of 3.5 with a first request in flight at the upgrade)."""
        with self._lock:
            current = self.sessions.get(name)
            if current is not None and not isinstance(current, CountedRuns):
                return  # its serving form already (a graph opened by its first use, the batch graph's)
            quick = self.sessions.pop(name, None)
            if isinstance(quick, CountedRuns):
                quick.runs.wait_idle(wait_s)
            del quick
            self.sessions[name] = self._open(name, quick=False)

    def prepack_batch_graph(self) -> None:
        """Serve the LM's batch graph from now on prepacked (``llm_gemm=auto`` once steps serve several rows; a
        run in flight on the unpacked session keeps it until it returns)."""
        with self._lock:
            self.prepack_batch = True
            self.sessions[BATCH_STEP] = self._open(BATCH_STEP, quick=False)

    def graph_file(self, name: str) -> Path:
        """The ONNX file of graph ``name`` (the int8 step graph's where the LM steps in int8)."""
        int8 = self.int8 and name == "llm_step"
        return self.dir / (INT8_STEP if int8 else self.graphs[name])

    def weights_file(self, name: str) -> Path:
        """Where graph ``name``'s external weights lie, if it has them: beside it, ``.data`` added."""
        graph = self.graph_file(name)
        return graph.with_name(graph.name + ".data")

    def _open(self, name: str, quick: bool) -> Any:
        import onnxruntime as ort

        int8 = self.int8 and name == "llm_step"
        if name not in self.graphs:
            raise BundleError(
                f"{self.path}: its lite graphs ({', '.join(self.parts)}) hold no {name!r} graph"
            )
        path = self.graph_file(name)
        # the LM's float graphs: no prepacking, no rewrites (they open before READY); flow and vocoder (after
        # READY) prepacked and fully optimized (their convolutions run ~30% faster so, the estimator's 50-frame
        # step 250 ms instead of 310); the int8 step graph prepacked (its steps 2.3x faster). No graph gets the
        # buffer-reuse plan: it took 0.9 of the full-size estimator's 2.2 s open and 0.1 of the vocoder's 0.24
        # (2-core Xeon), its runs and peak RSS the same without it (the arena reuses freed blocks anyway)
        lm = name.startswith("llm_")
        batch = self.prepack_batch and name == BATCH_STEP
        options = session_options(
            self.threads,
            prepack=not quick and (self.prepack or int8 or batch or not lm),
            optimize=int8 or not (lm or quick),  # the int8 step graph's rewrites were made at conversion
            plan_reuse=False,
        )
        try:
            return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - ORT raises its own types; the file is what is wrong
            raise BundleError(f"{path}: ONNX Runtime cannot open it ({e})") from e

    def tables(self) -> dict[str, np.ndarray]:
        """The tables file's arrays, mapped read-only (a page costs memory once read)."""
        return map_safetensors(self.dir / TABLES_FILE)

    def data_files(self) -> list[Path]:
        """The weight files this runtime maps (the int8 or the float step graph's, not both; the int8 LM opens no
        batch graph)."""
        if self.int8:  # not the float step graph's weights (which the batch graph reads)
            unused = [self.graphs[g] for g in ("llm_step", BATCH_STEP) if g in self.graphs]
        else:
            unused = [INT8_STEP]
        skip = {name + ".data" for name in unused}
        return [f for f in sorted(self.dir.glob("*.data")) if f.name not in skip] + [self.dir / TABLES_FILE]


class LiteFlow:
    """Speech tokens -> mel over the ``flow_encoder``, ``flow_regulator`` and ``flow_estimator`` graphs."""

    def __init__(self, bundle: LiteBundle, tables: dict[str, np.ndarray], n_timesteps: int | None = None):
        c = bundle.config["flow"]
        self.bundle = bundle
        self.cfg = SimpleNamespace(**c)  # attributes, as the torch flow's config
        self.input_frame_rate = int(c["input_frame_rate"])
        self.output_size = int(c["output_size"])
        self.in_channels = int(c["in_channels"])
        self.n_timesteps = int(n_timesteps or c["n_timesteps"])
        self.scheduler = str(c["t_scheduler"])
        self.cfg_rate = float(c["inference_cfg_rate"])
        self.spk_w, self.spk_b = tables["flow.spk_affine.weight"], tables["flow.spk_affine.bias"]

    def regulate(self, h: np.ndarray, p: int, f: int, m: int) -> np.ndarray:
        """Resample the prompt's and the target's encoder frames (N, C) to f + m mel frames -> mu (C, f + m)."""
        x2 = h[p:].T
        if x2.shape[1] > 2 * OVERLAP_TOKENS:
            n, edge = OVERLAP_TOKENS, mel_length(OVERLAP_TOKENS, self.input_frame_rate)
            x2 = np.concatenate(
                [
                    dsp.interp_linear(x2[:, :n], edge),
                    dsp.interp_linear(x2[:, n:-n], m - 2 * edge),
                    dsp.interp_linear(x2[:, -n:], edge),
                ],
                axis=1,
            )
        else:
            x2 = dsp.interp_linear(x2, m)
        if p:
            x2 = np.concatenate([dsp.interp_linear(h[:p].T, f), x2], axis=1)
        (mu,) = self.bundle.session("flow_regulator").run(None, {"x": x2[None].astype(np.float32)})
        return mu[0]

    ops = ArrayOps(np)  # the array ops of the token2wav that drives it (numpy's)

    def inference(
        self,
        token: np.ndarray,
        token_len: Any,
        prompt_token: np.ndarray,
        prompt_token_len: Any,
        prompt_feat: np.ndarray,
        prompt_feat_len: Any,
        embedding: np.ndarray,
        flow_cache: np.ndarray,
        *,
        noise: np.ndarray | None = None,
        generator: np.random.Generator | None = None,
        n_timesteps: int | None = None,
        should_stop: ShouldStop | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The torch flow's ``inference`` (:meth:`cosyserve.models.flow.MaskedDiffWithXvec.inference`, one row),
        the same shapes in numpy: (mel (1, 80, M), the cache the next window continues (1, 80, F + 34, 2)).

        Args:
            token, prompt_token: (1, T), (1, P) speech token ids (the lengths are their shapes'; the ``*_len``
                arguments are the protocol's).
            prompt_feat: (1, F, 80) prompt mel.
            embedding: (1, 192) speaker x-vector.
            flow_cache: (1, 80, C, 2) the previous window's cache (C may be 0).
            noise: (1, 80, F + M) the starting sample; drawn from ``generator`` (numpy's) when None.
            should_stop: asked before each Euler step; it also ends a graph's run early
                (:class:`cosyserve.core.stop.Stopped`).
        """
        prompt = np.asarray(prompt_token).reshape(-1)
        ids = np.concatenate([prompt, np.asarray(token).reshape(-1)]).astype(np.int64)[None]
        p, t = prompt.shape[0], ids.shape[1] - prompt.shape[0]
        (h,) = terminate.run(self.bundle.session("flow_encoder"), {"tokens": ids}, should_stop)
        feat = np.asarray(prompt_feat, dtype=np.float32).reshape(-1, self.output_size)  # (F, 80)
        f, m = feat.shape[0], mel_length(t, self.input_frame_rate)
        mu = self.regulate(h[0], p, f, m)  # (80, f + m)
        total = f + m
        spks = (dsp.normalize(np.asarray(embedding).reshape(-1)) @ self.spk_w.T + self.spk_b)[0]  # (80,)
        if noise is None:
            if generator is None:
                raise ValueError("the flow draws its starting noise: pass generator= or noise=")
            z = generator.standard_normal((self.output_size, total), dtype=np.float32)
        else:
            z = np.asarray(noise, dtype=np.float32)[0].copy()
        cache = flow_cache[0]  # (80, C, 2)
        if cache.shape[1] > 0:
            c = cache.shape[1]
            z[:, :c], mu = cache[:, :, 0], mu.copy()
            mu[:, :c] = cache[:, :, 1]
        tail = CACHE_TAIL_FRAMES
        new_cache = np.stack(
            [np.concatenate([z[:, :f], z[:, -tail:]], 1), np.concatenate([mu[:, :f], mu[:, -tail:]], 1)], -1
        )
        n = self.output_size
        h_in = np.zeros((2, self.in_channels, total), np.float32)
        h_in[0, n : 2 * n] = mu
        h_in[0, 2 * n : 3 * n] = spks[:, None]
        if f:
            h_in[0, 3 * n : 4 * n, :f] = feat.T
        est = self.bundle.session("flow_estimator")
        x = z
        rate = np.float32(self.cfg_rate)
        for t_, dt in dsp.euler_schedule(n_timesteps or self.n_timesteps, self.scheduler):
            check(should_stop)
            h_in[:, :n] = x
            (vel,) = terminate.run(est, {"h": h_in, "t": np.full(2, t_, np.float32)}, should_stop)
            vel = (np.float32(1.0) + rate) * vel[0] - rate * vel[1]
            x = x + dt * vel
        return x[None, :, f:].astype(np.float32), new_cache[None]


class LiteVocoder:
    """Mel -> audio over the ``hift_f0`` and ``hift_decode`` graphs, the sine source and the iSTFT in numpy."""

    def __init__(self, bundle: LiteBundle, tables: dict[str, np.ndarray]) -> None:
        self.bundle = bundle
        self.cfg = dict(bundle.config["hift"])
        self.w, self.b = tables["hift.source.weight"], tables["hift.source.bias"]
        self.harmonics = int(self.cfg["nb_harmonics"]) + 1
        self.upsample = int(self.cfg["upsample_factor"])

    def draws(self, frames: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(sine_phase (1, H, 1) uniform in [-pi, pi), sine_noise (1, H, L) standard normal) for ``frames`` mel
        frames, drawn from ``rng`` in that order: what :meth:`inference` draws when none are given."""
        h, n = self.harmonics, frames * self.upsample
        phase = (rng.random((1, h, 1), dtype=np.float32) * np.float32(2 * np.pi) - np.float32(np.pi)).astype(
            np.float32
        )
        return phase, rng.standard_normal((1, h, n), dtype=np.float32)

    def inference(
        self,
        speech_feat: np.ndarray,
        cache_source: np.ndarray | None = None,
        *,
        generator: np.random.Generator | None = None,
        sine_phase: np.ndarray | None = None,
        sine_noise: np.ndarray | None = None,
        should_stop: ShouldStop | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The torch vocoder's ``inference`` (:meth:`cosyserve.models.hift.HiFTGenerator.inference`, one row), the
        same shapes in numpy: mel (1, 80, T), cache_source (1, 1, S) -> (speech (1, L), source (1, 1, L)),
        L = T * upsample; the source's first S samples are ``cache_source``. The draws ``sine_phase`` and
        ``sine_noise`` (:meth:`draws`'s shapes) come from ``generator`` (numpy's) when not given. ``should_stop``
        ends its graphs' runs early (:class:`cosyserve.core.stop.Stopped`)."""
        if sine_phase is None or sine_noise is None:
            if generator is None:
                raise ValueError(
                    "the vocoder draws random numbers: pass generator= or sine_phase= and sine_noise="
                )
        phase, noise = self._draws(speech_feat.shape[2], generator, sine_phase, sine_noise)
        c = self.cfg
        mel = np.ascontiguousarray(speech_feat[0], dtype=np.float32)[None]  # (1, 80, T)
        (f0,) = terminate.run(self.bundle.session("hift_f0"), {"mel": mel}, should_stop)
        source = self._source(f0[0], phase, noise)
        if cache_source is not None and cache_source.size > 0:
            cache = np.asarray(cache_source).reshape(-1)
            source[: cache.shape[0]] = cache
        check(should_stop)
        n_fft, hop = int(c["n_fft"]), int(c["hop_len"])
        s_stft = dsp.source_stft(source, n_fft, hop)[None]
        (x,) = terminate.run(self.bundle.session("hift_decode"), {"mel": mel, "s_stft": s_stft}, should_stop)
        speech = dsp.spectrum_wave(x[0], n_fft, hop)
        limit = np.float32(c["audio_limit"])
        return np.clip(speech, -limit, limit)[None], source[None, None]

    def _draws(
        self, frames: int, generator: Any, sine_phase: np.ndarray | None, sine_noise: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        # the source's (phase (H, 1), noise (H, L)): the given draws, or drawn in the torch vocoder's order
        if sine_phase is None or sine_noise is None:
            drawn = self.draws(frames, generator)
            sine_phase = drawn[0] if sine_phase is None else sine_phase
            sine_noise = drawn[1] if sine_noise is None else sine_noise
        return np.asarray(sine_phase)[0], np.asarray(sine_noise)[0]

    def _source(self, f0: np.ndarray, phase: np.ndarray, noise: np.ndarray) -> np.ndarray:
        # the excitation (T * upsample,) of f0 (T,): the 22.05 kHz SineGen
        c = self.cfg
        return dsp.sine_source(
            f0,
            upsample=self.upsample,
            sampling_rate=int(c["sampling_rate"]),
            nb_harmonics=int(c["nb_harmonics"]),
            alpha=float(c["nsf_alpha"]),
            sigma=float(c["nsf_sigma"]),
            voiced_threshold=float(c["nsf_voiced_threshold"]),
            weight=self.w,
            bias=self.b,
            phase=phase,
            noise=noise,
        )
