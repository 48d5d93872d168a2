"""The lite runtime's LMs: the decode loop's :class:`~cosyserve.runtime.lm.DecodeLM` over a bundle's ``llm_step``
and ``llm_batch`` graphs, with numpy tables for what is a lookup (embeddings, sos and
task rows).

One step graph per LM runs T new inputs against the P positions a cache row holds: its caches are graph inputs
(the past) and outputs (the new positions' keys and values). :class:`StepLM` keeps the caches as one numpy array
(buffers, rows, positions, ...): a row's past is the contiguous prefix ``cache[i, row, :P]``, bound as the input,
and the output is bound to ``cache[i, row, P:P+T]`` of the same array (ONNX Runtime's IO binding), so no cache is
copied between steps. A prefill, and a decode step of one row, run the step graph.

A decode step of B > 1 rows runs the batch graph once where the bundle has it (both LMs'
:data:`~cosyserve.bundle.lite.BATCH_STEP`, its session opened by the first such step: a server whose requests never
overlap never opens it): one token per row, each at its own position, against the first rows of the
cache array bound as they are (rows 0..n-1: a row that does not step is fed padding; each row's positions from
its own on are masked in the graph). Its new keys and values go to a small staging array and are written into
each row's next position after the run (B rows x buffers x one position's floats). Its bindings over the cache
array are kept between steps. Without it a step's rows run one after another through the step graph, each run
ended early by its row's stop signal (:func:`cosyserve.runtime.lite.terminate.run_bound`), and
:attr:`StepLM.unbatched` says why (the runtime logs it once): the int8 step graph, whose ONNX Runtime dynamic
quantization scales a run's activations with one scale per tensor, i.e. across its rows, so a row's tokens would
depend on its neighbours (rows of one run must each get their tokens as alone); or a bundle converted before its
LM had a batch graph (it still serves; converting it again batches its rows). A batched run is ended early when
every row's signal says stop (a step is one token's work: the loop ends a stopped row after it).

- :class:`LiteLM`: CosyVoice-300M's (a conformer text encoder graph, relative positions as projections
  computed by the ``llm_pos`` graph and kept, caches (positions, heads, head_dim) per layer).
- :class:`LiteQwenLM`: CosyVoice2's and CosyVoice3's Qwen2 LM (the text embedding a mapped table, rotary
  positions inside the graph, caches (positions, head_dim) per layer and KV head: the graph's attention reads
  each as a plain matrix, so nothing is transposed per step). Its rules come from the manifest: stop ids, fill
  and mix ratio, and CosyVoice3's ``<|endofprompt|>`` (:class:`~cosyserve.core.sampling.StopRules`).

Nothing here imports torch.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cosyserve.bundle.lite import BATCH_STEP, qwen_cache_names
from cosyserve.core.errors import BundleError
from cosyserve.core.sampling import ArrayOps, SamplingConfig, StopRules
from cosyserve.core.stop import ShouldStop, Stopped
from cosyserve.models import lite_dsp as dsp
from cosyserve.runtime.lite import terminate
from cosyserve.runtime.lm import Part

__all__ = ["LiteLM", "LiteQwenLM", "StepLM", "lite_lm"]

POS_BLOCK = 256  # positional projections are computed in blocks of this many distances


def _flat(a: Any) -> list[int]:
    return [int(x) for x in np.asarray(a).reshape(-1)]


def _all_stopped(stops: Sequence[ShouldStop | None]) -> ShouldStop | None:
    # one run for every row of a step: ended early only when all of them stopped (the loop ends each stopped row
    # after the step)
    signals = [s for s in stops if s is not None]
    if len(signals) < len(stops):
        return None
    return lambda: all(s() for s in signals)


def _sampling(c: Mapping[str, Any]) -> SamplingConfig:
    s = c["sampling"]
    return SamplingConfig(float(s["top_p"]), int(s["top_k"]), int(s["win_size"]), float(s["tau_r"]))


class StepLM:
    """The decode loop's cache side over a bundle's ``llm_step`` graph (see the module docstring). A subclass
    names the graph's cache inputs and outputs (:attr:`cache_names`), the shape of one position of each
    (:attr:`cache_shape`), how a slice of a buffer is bound (:meth:`_view`), any further inputs
    (:meth:`_bind_extra`), and builds the prompt and embeddings."""

    rules: StopRules
    sampling: SamplingConfig
    cache_names: list[tuple[str, str]]  # (past input, new output) of each cache buffer, in one order
    cache_shape: tuple[int, ...]  # one position of one buffer
    speech_embedding: np.ndarray  # (speech vocabulary, C): a decode step's input

    def __init__(self, bundle: Any) -> None:
        self.bundle = bundle
        self.ops = ArrayOps(np)
        self.batch_steps = 0  # decode steps run by the batch graph
        # the batch graph (B rows, one token each) where the bundle has it, not for the int8 step graph (see the
        # module docstring); ``unbatched`` says why rows step one after another otherwise
        self.batch_graph: str | None = None
        self.unbatched: str | None = None
        if bundle.int8:
            self.unbatched = (
                "the int8 LM has no batch step (ONNX Runtime's dynamic int8 scales a run's activations across its "
                "rows: a row's tokens would depend on its neighbours)"
            )
        elif BATCH_STEP not in bundle.graphs:
            self.unbatched = (
                f"its lite graphs have no {BATCH_STEP!r} graph (converted by an older cosyserve); convert it again "
                "with --runtime lite and they share decode steps"
            )
        else:
            self.batch_graph = BATCH_STEP
        self.release()

    def _view(self, a: np.ndarray) -> np.ndarray:
        return a

    def _bind_extra(self, io: Any, positions: int, keep: list[Any]) -> None:
        """Bind inputs besides ``x``, ``pos`` and the caches, for a run that reads ``positions`` positions (a step:
        its past's and its new inputs'; a batch step: every position of the cache rows bound)."""

    def _embed_token(self, token: int) -> np.ndarray:
        """(1, 1, C) the input of a decode step that feeds speech token ``token``."""
        return self.speech_embedding[token].reshape(1, 1, -1)

    def _embed_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """(B, C) the inputs of a batch step that feeds speech tokens ``tokens`` (B,)."""
        return self.speech_embedding[tokens]

    def _run_step(self, x: np.ndarray, row: int, p: int, stop: ShouldStop | None) -> np.ndarray:
        """Run ``x`` (1, T, C) at positions p.. of cache row ``row`` (positions p..p+T written in place); (V,)."""
        import onnxruntime as ort

        t = x.shape[1]
        sess = self.bundle.session("llm_step")
        io = sess.io_binding()
        io.bind_cpu_input("x", np.ascontiguousarray(x, dtype=np.float32))
        keep = []  # the OrtValues over the buffers live until the run ends
        assert self._cache is not None, "reserve() first"
        for (past, new), buf in zip(self.cache_names, self._cache[:, row], strict=True):
            for name, arr, bind in (
                (past, buf[:p], io.bind_ortvalue_input),
                (new, buf[p : p + t], io.bind_ortvalue_output),
            ):
                val = ort.OrtValue.ortvalue_from_numpy(self._view(arr))
                keep.append(val)
                bind(name, val)
        self._bind_extra(io, p + t, keep)
        logp = np.empty((1, self.rules.vocab), np.float32)
        out = ort.OrtValue.ortvalue_from_numpy(logp)
        io.bind_ortvalue_output("logp", out)
        terminate.run_bound(sess, io, stop)
        return logp[0]

    def _batch_binding(self, sess: Any, n: int) -> Any:
        # an IO binding of cache rows 0..n-1 (inputs) and staging rows 0..n-1 (outputs), kept until the arrays change
        import onnxruntime as ort

        if sess is not self._bound_session:
            # a binding lives on in its session: one made on a session since replaced (llm_gemm=auto reopens the
            # batch graph prepacked) would run a freed session (a segfault)
            self._bound = {}
            self._bound_session = sess
        bound = self._bound.get(n)
        if bound is None:
            assert self._cache is not None and self._stage is not None, "reserve() first"
            io = sess.io_binding()
            keep = []
            for i, (past, new) in enumerate(self.cache_names):
                for name, arr, bind in (
                    (past, self._cache[i, :n], io.bind_ortvalue_input),
                    (new, self._stage[i, :n], io.bind_ortvalue_output),
                ):
                    val = ort.OrtValue.ortvalue_from_numpy(arr)
                    keep.append(val)
                    bind(name, val)
            self._bind_extra(io, self._cache.shape[2], keep)
            bound = self._bound[n] = (io, keep)  # the OrtValues over the arrays live as long as the binding
        return bound[0]

    def _run_batch(
        self,
        sess: Any,
        tokens: np.ndarray,
        pos: np.ndarray,
        rows: np.ndarray,
        stops: Sequence[ShouldStop | None],
    ) -> np.ndarray:
        """One batch graph run: token ``tokens[b]`` at position ``pos[b]`` of cache row ``rows[b]``; (B, V)."""
        import onnxruntime as ort

        assert self._cache is not None and self._stage is not None
        n = (
            int(rows.max()) + 1
        )  # cache rows 0..n-1 are bound as they are; the rows not in the step get padding
        emb = self._embed_tokens(tokens)  # (B, C)
        x = np.zeros((n, 1, emb.shape[1]), np.float32)
        x[rows, 0] = emb
        p = np.zeros(n, np.int64)
        p[rows] = pos
        io = self._batch_binding(sess, n)
        io.bind_cpu_input("x", x)
        io.bind_cpu_input("pos", p)
        logp = np.empty((n, self.rules.vocab), np.float32)
        io.bind_ortvalue_output("logp", ort.OrtValue.ortvalue_from_numpy(logp))
        try:
            terminate.run_bound(sess, io, _all_stopped(stops))
        except Stopped:
            self._bound.pop(n, None)
            return np.zeros((len(rows), self.rules.vocab), np.float32)
        self._cache[:, rows, pos] = self._stage[:, rows]  # each row's new keys and values at its position
        self.batch_steps += 1
        return logp[rows]

    # --- the decode loop's LM (cosyserve.runtime.lm.DecodeLM) -----------------------------------------------------

    def reserve(self, rows: int, positions: int) -> None:
        old = self._cache
        have = (0, 0) if old is None else old.shape[1:3]
        if rows <= have[0] and positions <= have[1]:
            return
        r, p = max(rows, have[0]), max(positions, have[1])
        # np.zeros maps untouched pages: a row costs memory only for the positions it reaches
        cache = np.zeros((len(self.cache_names), r, p, *self.cache_shape), np.float32)
        if old is not None:
            cache[:, : have[0], : have[1]] = old
        self._cache = cache
        self._stage = np.zeros((len(self.cache_names), r, *self.cache_shape), np.float32)
        self._bound = {}

    def release(self) -> None:
        self._cache: np.ndarray | None = None  # (buffers, rows, positions, *cache_shape)
        self._stage: np.ndarray | None = None  # (buffers, rows, *cache_shape): a batch step's new keys/values
        # rows bound -> the batch graph's IO binding and values, made on the session _bound_session
        self._bound: dict[int, tuple[Any, list[Any]]] = {}
        self._bound_session: Any = None

    def prefix_positions(self, model_input: Mapping[str, Any]) -> int:
        return 0  # a subclass whose input order allows a prefix says how many positions

    def save_prefix(self, row: int, positions: int) -> list[np.ndarray]:
        assert self._cache is not None, "reserve() first"
        return [buf[row, :positions].copy() for buf in self._cache]

    def load_prefix(self, arrays: list[np.ndarray], row: int) -> None:
        assert self._cache is not None, "reserve() first"
        for buf, a in zip(self._cache, arrays, strict=True):
            buf[row, : a.shape[0]] = a

    def extend(self, x: np.ndarray, row: int, start: int, stop: ShouldStop | None = None) -> np.ndarray:
        return self._run_step(x, row, start, stop)[None]

    def decode(
        self,
        tokens: np.ndarray,
        pos: np.ndarray,
        kv_len: int,
        rows: np.ndarray | None,
        stops: Sequence[ShouldStop | None] | None = None,
    ) -> np.ndarray:
        rows = np.arange(len(tokens)) if rows is None else np.asarray(rows)
        stops = [None] * len(tokens) if stops is None else stops
        if len(tokens) > 1 and self.batch_graph is not None:
            sess = self.bundle.session(self.batch_graph)  # opened by the first step of two rows or more
            return self._run_batch(sess, np.asarray(tokens), np.asarray(pos), rows, stops)
        out = np.zeros((len(tokens), self.rules.vocab), np.float32)
        for b, (token, p, r) in enumerate(zip(tokens.tolist(), pos.tolist(), rows.tolist(), strict=True)):
            try:
                out[b] = self._run_step(self._embed_token(token), r, p, stops[b])
            except Stopped:
                pass  # its row ends after the step (the decode loop asks its signal); the others go on
        return out

    def after_fork(self) -> None:
        """Make again what a fork copies in an unusable state (a lock held by another thread)."""

    def warmup_prompt(self) -> np.ndarray:
        """A one-position prompt (sos): a warm-up's prefill runs the step graph on one row, as a decode step does
        (a prefill of M > 1 rows packs every weight matrix per call without prepacking, ~100 ms at full size, and a
        first call costs no more than a later one)."""
        raise NotImplementedError


class LiteLM(StepLM):
    """CosyVoice-300M's LM over the ``llm_text``, ``llm_pos``, ``llm_step`` and ``llm_batch`` graphs."""

    def __init__(self, bundle: Any, tables: dict[str, np.ndarray]) -> None:
        super().__init__(bundle)
        c = bundle.config["llm"]
        self.layers, self.heads, self.head_dim = int(c["layers"]), int(c["heads"]), int(c["head_dim"])
        self.size = int(c["input_size"])
        self.eos_token = int(c["eos_token"])
        self.sampling = _sampling(c)
        self.rules = StopRules(self.eos_token + 1, self.eos_token, self.eos_token)
        n = self.layers
        self.cache_names = [(f"past_k{i}", f"new_k{i}") for i in range(n)]
        self.cache_names += [(f"past_v{i}", f"new_v{i}") for i in range(n)]
        self.cache_shape = (self.heads, self.head_dim)
        self.sos, self.task = tables["llm.sos"], tables["llm.task"]
        self.spk_w, self.spk_b = tables["llm.spk_affine.weight"], tables["llm.spk_affine.bias"]
        self.speech_embedding = tables["llm.speech_embedding"]
        table = tables.get("llm.pos_proj")  # (L, rows, H, D): the first distances, computed at conversion
        empty = np.zeros((self.layers, 0, self.heads, self.head_dim), np.float32)
        self._pos: list[np.ndarray] = list(table if table is not None else empty)
        self._pos_lock = threading.Lock()

    def _view(self, a: np.ndarray) -> np.ndarray:
        return a[None]  # the graph's caches are (1, P, H, D)

    def after_fork(self) -> None:
        self._pos_lock = threading.Lock()

    def _positions(self, n: int) -> list[np.ndarray]:
        # every layer's linear_pos(pe) for distances [0, n): weight-only, computed in blocks and kept
        pos = self._pos
        if pos[0].shape[0] >= n:
            return pos
        with self._pos_lock:
            pos = self._pos
            have = pos[0].shape[0]
            if have < n:
                stop = -(-n // POS_BLOCK) * POS_BLOCK
                pe = dsp.distance_pe(self.size, have, stop)
                (proj,) = self.bundle.session("llm_pos").run(None, {"pe": pe})  # (L, rows, H, D)
                # new arrays (a running request keeps the ones it bound)
                self._pos = pos = [np.concatenate([pos[i], proj[i]]) for i in range(self.layers)]
        return pos

    def _bind_extra(self, io: Any, positions: int, keep: list[Any]) -> None:
        import onnxruntime as ort

        for i, arr in enumerate(self._positions(positions)):
            val = ort.OrtValue.ortvalue_from_numpy(arr[:positions])
            keep.append(val)
            io.bind_ortvalue_input(f"pos{i}", val)

    def _prompt(
        self, text: list[int], prompt_text: list[int], prompt_speech: list[int], embedding: np.ndarray | None
    ) -> np.ndarray:
        """The LM's prompt (1, T0, C): sos, [speaker], encoded prompt text + text, task id, prompt speech."""
        ids = np.asarray([list(prompt_text) + list(text)], dtype=np.int64)
        (encoded,) = self.bundle.session("llm_text").run(None, {"text": ids})
        parts = [self.sos.reshape(1, -1)]
        if embedding is not None and embedding.size:
            parts.append(dsp.normalize(embedding) @ self.spk_w.T + self.spk_b)
        parts += [encoded[0], self.task.reshape(1, -1)]
        if prompt_speech:
            parts.append(self.speech_embedding[np.asarray(prompt_speech, dtype=np.int64)])
        return np.concatenate(parts).astype(np.float32)[None]

    def prompt(self, model_input: Mapping[str, Any]) -> tuple[np.ndarray, int]:
        """The one-shot prompt (1, T0, C) of a reference model-input dict and its text's length."""
        text = _flat(model_input["text"])
        embedding = model_input.get("llm_embedding")
        emb = None if embedding is None else np.asarray(embedding, dtype=np.float32).reshape(-1)
        prompt = self._prompt(
            text,
            _flat(model_input.get("prompt_text", [])),
            _flat(model_input.get("llm_prompt_speech_token", [])),
            emb,
        )
        return prompt, len(text)

    def embed(self, parts: list[Part]) -> np.ndarray:
        for kind, _ in parts:
            if kind != "speech":
                raise ValueError(f"the lite LM takes no {kind!r} input after its prompt")
        ids = [t for _, p in parts for t in p]
        return self.speech_embedding[np.asarray(ids, dtype=np.int64)][None].astype(np.float32)

    def warmup_prompt(self) -> np.ndarray:
        # the text encoder's graph opens after READY
        return self.sos.reshape(1, 1, -1).astype(np.float32)


class LiteQwenLM(StepLM):
    """CosyVoice2's and CosyVoice3's Qwen2 LM over the ``llm_step`` and ``llm_batch`` graphs; embeddings from the
    tables."""

    def __init__(self, bundle: Any, tables: dict[str, np.ndarray]) -> None:
        super().__init__(bundle)
        c = bundle.config["llm"]
        r = c["rules"]
        self.rules = StopRules(
            int(r["vocab"]), int(r["eos_token"]), int(r["eos"]),
            None if r["fill"] is None else int(r["fill"]), (int(r["mix_ratio"][0]), int(r["mix_ratio"][1])),
            int(r["sos"]), int(r["task_id"]), None if r["marker"] is None else int(r["marker"]),
        )  # fmt: skip
        self.sampling = _sampling(c)
        self.cache_names = qwen_cache_names(int(c["layers"]), int(c["kv_heads"]))
        self.cache_shape = (int(c["head_dim"]),)
        self.text_embedding = tables["llm.text_embedding"]  # (text vocabulary, C): rows read as used
        self.speech_embedding = tables["llm.speech_embedding"]
        self.special = {self.rules.sos: tables["llm.sos"], self.rules.task_id: tables["llm.task"]}

    def _rows(self, table: np.ndarray, ids: list[int], what: str) -> np.ndarray:
        a = np.asarray(ids, dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() >= table.shape[0]):
            raise ValueError(f"{what} ids must be in [0, {table.shape[0]}), got {a.min()}..{a.max()}")
        return table[a].astype(np.float32, copy=False)

    def prompt(self, model_input: Mapping[str, Any]) -> tuple[np.ndarray, int]:
        """The one-shot prompt (1, T0, C): sos, the text embeddings of prompt text + text, task_id, the prompt
        speech tokens' embeddings (the speaker embedding is not used, as in the reference); and the text's
        length."""
        text = _flat(model_input["text"])
        ids = _flat(model_input.get("prompt_text", [])) + text
        self.rules.require_marker(ids)
        x = self.embed(
            [
                ("special", [self.rules.sos]),
                ("text", ids),
                ("special", [self.rules.task_id]),
                ("speech", _flat(model_input.get("llm_prompt_speech_token", []))),
            ]
        )
        return x, len(text)

    def prefix_positions(self, model_input: Mapping[str, Any]) -> int:
        # sos and the prompt text (as the torch Qwen2LM's)
        p = len(_flat(model_input.get("prompt_text", [])))
        return 1 + p if p else 0

    def embed(self, parts: list[Part]) -> np.ndarray:
        out = []
        for kind, ids in parts:
            if not ids:
                continue
            if kind == "text":
                out.append(self._rows(self.text_embedding, ids, "text"))
            elif kind == "speech":
                out.append(self._rows(self.speech_embedding, ids, "speech token"))
            elif kind == "special" and all(t in self.special for t in ids):
                out.append(np.stack([self.special[t].reshape(-1) for t in ids]))
            else:
                raise ValueError(f"the lite Qwen LM takes no {kind!r} input {ids}")
        return np.concatenate(out).astype(np.float32, copy=False)[None]

    def warmup_prompt(self) -> np.ndarray:
        return self.special[self.rules.sos].reshape(1, 1, -1).astype(np.float32)


_LMS: dict[str, type[StepLM]] = {"transformer": LiteLM, "qwen2": LiteQwenLM}


def lite_lm(bundle: Any, tables: dict[str, np.ndarray]) -> StepLM:
    """The LM a lite bundle's manifest describes (its ``llm.arch``; CosyVoice-300M's when absent)."""
    arch = bundle.config["llm"].get("arch", "transformer")
    cls = _LMS.get(arch)
    if cls is None:
        raise BundleError(
            f"{bundle.dir}/manifest.json: LM architecture {arch!r} is not one this cosyserve serves "
            f"({', '.join(_LMS)}): convert again with --runtime lite"
        )
    return cls(bundle, tables)
