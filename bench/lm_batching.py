"""The LM's batching by default (issue 32): a lone request's first audio against the unbatched path of another
source tree, and the audio of N concurrent one-shot requests against one.

    # a lone request's first audio: this tree with default settings vs a baseline tree with batch_size 1
    git -C REPO archive 30ab4df src | tar -x -C /tmp/base
    python bench/lm_batching.py first-audio --model CV2_BUNDLE --baseline-src /tmp/base/src [--rounds 15]
    # audio seconds per wall second, 8 concurrent one-shot requests vs 1 (default settings)
    python bench/lm_batching.py throughput --model CV2_BUNDLE [--concurrency 8]
    # the same for streamed requests with token2wav stacked across them (batch_flow): how many flow (streamed
    # chunks) and vocoder calls ran stacked, and the audio seconds per wall second of N concurrent streams vs one;
    # on a GPU, with and without --batch-flow (same machine, one after the other)
    COSYSERVE_DEVICE=cuda python bench/lm_batching.py throughput --model CV3_BUNDLE --stream --batch-flow --concurrency 4
    COSYSERVE_DEVICE=cuda python bench/lm_batching.py throughput --model CV3_BUNDLE --stream --concurrency 4
    # the same with bounded flow contexts (--flow-context 8: a stream's last call is a chunk too, and stacks)
    python bench/lm_batching.py throughput --model CV2_BUNDLE --stream --batch-flow --flow-context 8
    python bench/lm_batching.py --dry-run      # both, on a tiny CosyVoice2 model made here (CI: tests/test_bench_lm)
    # the lite runtime (a bundle converted with --runtime lite): the same, --runtime lite (the baseline tree's lite
    # rows stepped one after another; this tree's share the batch graph's runs)
    python bench/lm_batching.py first-audio --runtime lite --model CV3_LITE_BUNDLE --baseline-src /tmp/base/src
    python bench/lm_batching.py throughput --runtime lite --model CV3_LITE_BUNDLE [--concurrency 4]
    # llm_gemm=auto's packing for batches in place before the measured runs: a first concurrent burst, unmeasured
    # (the lite batch graph is prepacked at the first moment with no request in flight after it)
    python bench/lm_batching.py throughput --runtime lite --model CV3_LITE_BUNDLE --concurrency 4 --prime
    # CosyVoice-300M's lite LM batches the same way: a 300M-SFT bundle (its speakers speak; convert it again with
    # --runtime lite so it has llm_batch); the same run on a tree from before (e28b58e: its 300M rows stepped one
    # after another, "lite batch steps 0") imports that tree's cosyserve
    python bench/lm_batching.py throughput --runtime lite --model SFT_LITE_BUNDLE [--concurrency 4]
    PYTHONPATH=/tmp/base/src python bench/lm_batching.py throughput --runtime lite --model SFT_LITE_BUNDLE

first-audio: two worker processes, one per source tree (``PYTHONPATH``), each loads the model once (warm-up on)
and then speaks one streamed request at a time when asked; the requests alternate between them (interleaved pairs,
the order swapped every round) so both see the same machine. The baseline runs with ``batch_size=1`` (the
unbatched path of a tree from before batching was the default), this tree with no batch setting (its default). A
request's first audio: ``synthesize(stream=True)`` called until its first chunk, in the worker, then closed
(random weights speak to the length limit: the rest would take minutes per request) (the engine, HTTP
and encoding are the same code in both trees and left out). Printed: the median of each and their ratio (target:
this tree / baseline <= 1.05).

throughput: one process of this tree, the model loaded with default settings; one request alone, then
``--concurrency`` requests at once (threads, each its own seed, the same text), then one alone again: audio seconds
over wall seconds for the concurrent run against the mean of the two lone ones (this VM's speed drifts by 20-40%
over minutes), their ratio (target >= 2 at 8), and the LM's mean rows per decode step over the concurrent run.
With ``llm_gemm=auto`` the concurrent run's first batched step packs the LM's linears: the lone request after it
is a server's steady state once it has served concurrent requests.
``--stream`` makes every request streamed (chunks as the model's chunk policy cuts them); ``--batch-flow`` loads
with ``batch_flow=True`` and prints, per token2wav part the family stacks, its calls in the concurrent run, how
many of them ran stacked, the mean calls per run and how many gathers ran out (``--gather-ms``: how long a call
waits for partners while another stream runs; a lone stream never waits). The flow of CosyVoice2/3 counts its streamed chunks (the calls
that stack: every stream's rows in one estimator call per Euler step; a stream's last call, full attention over
every frame, runs alone unless ``--flow-context`` bounds the streams: then it is a chunk too). On a GPU (``COSYSERVE_DEVICE=cuda``) run it with and without ``--batch-flow``: the
ratio of the two concurrent figures is what stacking gains.

Random weights seldom draw a stop id: most requests run their LM to its length limit (one of 8 stopped at 12.1 s
of 12.8 in a full-size run), so the audio of the lone request and of each concurrent one is printed beside the
rates. The figures share the machine's cores with everything else on it: run on a quiet machine, name the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
TEXT = "Hello there, this is a test of the first audio of a lone request."
DRY_TEXT = "Hello there."


def _layouts() -> dict[int, dict[str, int]]:
    """Rows per step -> how many weight shapes llm_gemm=auto decided for each layout (cosyserve.models.gemm)."""
    from cosyserve.models.gemm import decisions

    kept: dict[int, dict[str, int]] = {}
    for (_out, _in, rows), way in sorted(decisions().items()):
        kept.setdefault(rows, {}).setdefault(way, 0)
        kept[rows][way] += 1
    return kept


def _load(
    model: str,
    batch_size: int | None,
    batch_flow: bool = False,
    runtime: str | None = None,
    flow_context: float = 0.0,
) -> Any:
    import cosyserve

    options: dict[str, Any] = {"warmup": True, "runtime": runtime}
    if batch_size is not None:
        options["batch_size"] = batch_size
    if batch_flow:
        options["batch_flow"] = True
    if flow_context:
        options["flow_context_seconds"] = flow_context
    return cosyserve.load(model, **options)


def worker(model: str, text: str, batch_size: int | None, runtime: str | None = None) -> None:
    """Answer each seed read from stdin with one JSON line: the request's first audio and its audio seconds."""
    m = _load(model, batch_size, runtime=runtime)
    speaker = m.speakers[0] if m.speakers else None
    join = getattr(m.runtime, "join_background", None)  # the work a runtime does after READY (warm-up), done
    if join is not None:  # before the first pair: it would slow the other worker's first request
        join()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        seed = int(line)
        t = time.perf_counter()
        chunks = m.synthesize(text, speaker=speaker, stream=True, seed=seed)
        first = next(chunks, None)  # None: the LM drew its stop id at once (random CosyVoice3 weights can)
        first_s = time.perf_counter() - t
        chunks.close()  # the rest is not measured: the request ends here (its cache row freed)
        samples = 0 if first is None else first.size
        print(json.dumps({"first_audio_s": first_s, "first_chunk_s": samples / m.sample_rate}), flush=True)


class _Worker:
    def __init__(
        self, src: Path, model: str, text: str, batch_size: int | None, runtime: str | None = None
    ) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "_worker", "--model", model, "--text", text]
        if batch_size is not None:
            cmd += ["--batch-size", str(batch_size)]
        if runtime is not None:
            cmd += ["--runtime", runtime]
        env = {**os.environ, "PYTHONPATH": str(src)}
        env.pop("COSYSERVE_BATCH_SIZE", None)  # each tree's own default, or the batch given
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._line()  # ready

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.args} ended (exit {self.proc.wait()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, seed: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{seed}\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


def first_audio(
    model: str, baseline_src: Path, rounds: int, text: str, runtime: str | None = None
) -> dict[str, Any]:
    workers = {
        "baseline": _Worker(baseline_src, model, text, 1, runtime),
        "this tree": _Worker(SRC, model, text, None, runtime),
    }
    times: dict[str, list[float]] = {name: [] for name in workers}
    # CPU the other (idle) worker used while one spoke: a worker that spins or works in the background between
    # its requests slows the other's, which would make the pair unfair
    idle_cpu: dict[str, list[float]] = {name: [] for name in workers}
    try:
        for r in range(rounds):
            order = list(workers) if r % 2 == 0 else list(reversed(workers))
            for name in order:
                (other,) = (n for n in workers if n != name)
                before = _cpu_s(workers[other].proc.pid)
                times[name].append(workers[name].ask(seed=r)["first_audio_s"])
                idle_cpu[other].append(_cpu_s(workers[other].proc.pid) - before)
    finally:
        for w in workers.values():
            w.close()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    out = {
        "rounds": rounds,
        "median_s": med,
        "samples_s": times,
        "idle_cpu_s": {name: statistics.mean(v) for name, v in idle_cpu.items()},
        "ratio": med["this tree"] / med["baseline"],
    }
    print(f"first audio of a lone request, median of {rounds} interleaved pairs:")
    for name, s in med.items():
        samples = " ".join(f"{t * 1e3:.0f}" for t in times[name])
        print(f"  {name:10s} {s * 1e3:8.0f} ms   (each: {samples})")
    for name, cpu in out["idle_cpu_s"].items():
        each = " ".join(f"{c * 1e3:.0f}" for c in idle_cpu[name])
        print(
            f"  {name:10s} used {cpu * 1e3:6.0f} ms of CPU on average while idle (the other's request; {each})"
        )
    print(f"  this tree / baseline: {out['ratio']:.3f} (target <= 1.05)")
    return out


def _cpu_s(pid: int) -> float:
    # user + system CPU seconds of a process, all its threads (/proc/PID/stat fields 14 and 15)
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stackers(m: Any) -> dict[str, Any]:
    # the token2wav parts that batch_flow stacked (runtime.stacking), by part
    t2w = m.runtime.pipeline.token2wav
    return {part: getattr(t2w, part) for part in ("flow", "hift") if hasattr(getattr(t2w, part), "stats")}


def throughput(
    model: str,
    concurrency: int,
    text: str,
    stream: bool = False,
    batch_flow: bool = False,
    gather_ms: float | None = None,
    batch_size: int | None = None,
    runtime: str | None = None,
    flow_context: float = 0.0,
    prime: bool = False,
) -> dict[str, Any]:
    import dataclasses

    m = _load(model, batch_size, batch_flow, runtime, flow_context)
    speaker = m.speakers[0] if m.speakers else None
    decoder = m.runtime.pipeline.decoder
    m.synthesize_all(text, speaker=speaker, seed=0, stream=stream)  # the paths warm
    stackers = _stackers(m)
    for b in stackers.values():
        if gather_ms is not None:
            b.gather_s = gather_ms / 1000

    def run(n: int) -> tuple[list[float], float]:
        audio = [0.0] * n

        def one(i: int) -> None:
            audio[i] = (
                m.synthesize_all(text, speaker=speaker, seed=100 + i, stream=stream).size / m.sample_rate
            )

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t
        return audio, wall

    if prime:
        # a first burst, not measured: llm_gemm=auto packs for batched steps after it (torch: in a thread at once;
        # lite: the batch graph at the first moment with no request in flight), waited for here
        run(concurrency)
        for part in (getattr(m.runtime, "autopack", None), getattr(m.runtime, "batch_pack", None)):
            if part is not None:
                part.join(300)
    lone, w1 = run(1)
    a1 = sum(lone)
    steps0, rows0 = decoder.stats.steps, decoder.stats.rows
    graph0 = getattr(decoder.lm, "batch_steps", 0)  # the lite LM's steps run by its batch graph
    before = {part: dataclasses.replace(b.stats) for part, b in stackers.items()}
    trace: list[tuple[float, int]] = []  # (time, rows) of each decode step of the concurrent run
    told = decoder.on_step

    def on_step(rows: int) -> None:
        trace.append((time.perf_counter(), rows))
        if told is not None:
            told(rows)

    decoder.on_step = on_step
    t0 = time.perf_counter()
    each, wn = run(concurrency)
    an = sum(each)
    decoder.on_step = told
    steps, rows = decoder.stats.steps - steps0, decoder.stats.rows - rows0
    # the lone request again, after: this VM's speed drifts over minutes, so the concurrent run is compared with
    # the mean rate of a lone request on either side of it
    lone_after, w1_after = run(1)
    stacked = {}
    for part, b in stackers.items():
        calls = b.stats.calls - before[part].calls
        batched = b.stats.batched_calls - before[part].batched_calls
        runs = calls - batched + b.stats.batches - before[part].batches
        stacked[part] = {
            "calls": calls,
            "stacked_calls": batched,
            "mean_batch": calls / runs if runs else 0.0,
            "timed_out": b.stats.timed_out - before[part].timed_out,
        }
    rates = [a1 / w1, sum(lone_after) / w1_after]
    out = {
        "primed": prime,
        "batch_size": decoder.max_rows,
        "stream": stream,
        "flow_context_seconds": flow_context,
        "one": statistics.mean(rates),
        "one_before_after": rates,
        # a random-weight LM stops where its samples say: a lone request much shorter than the concurrent ones
        # pays its fixed costs (prompt, first chunk) over fewer audio seconds, and the ratio flatters
        "one_audio_s": a1,
        "concurrent_audio_s": each,
        "concurrent": an / wn,
        "ratio": (an / wn) / statistics.mean(rates),
        "mean_rows": rows / steps if steps else 0.0,
        "batch_graph_steps": getattr(decoder.lm, "batch_steps", 0) - graph0,
        "stacked": stacked,
    }
    what = "streams" if stream else "requests"
    which = "the default" if batch_size is None else "--batch-size"
    print(
        f"audio s per wall s (batch_size {out['batch_size']}, {which}; batch_flow {batch_flow}; "
        f"flow_context_seconds {flow_context:g}):"
    )
    print(
        f"  1 of the {what:<8}    {out['one']:.3f} (the mean of one before, {a1:.1f} s of audio in {w1:.1f} s, "
        f"and one after, {sum(lone_after):.1f} s in {w1_after:.1f} s)"
    )
    print(
        f"  {concurrency} concurrent        {out['concurrent']:.3f} ({an:.1f} s of audio in {wn:.1f} s; each "
        + " ".join(f"{a:.1f}" for a in each)
        + ")"
    )
    print(f"  ratio               {out['ratio']:.2f} (target >= 2 at 8)")
    print(
        f"  LM rows per step    {out['mean_rows']:.2f}{' (after a first burst, not measured)' if prime else ''}"
    )
    if hasattr(decoder.lm, "batch_steps"):
        out["batch_graph_prepacked"] = bool(m.runtime.lite.prepack_batch)
        print(
            f"  lite batch steps    {out['batch_graph_steps']} of {steps} "
            f"(the batch graph {'prepacked' if out['batch_graph_prepacked'] else 'unpacked'})"
        )
    # when the steps ran, and with how many rows: tenths of the concurrent run's wall time
    print("  timeline (tenths of the run): steps / mean rows per step")
    tenths = [[r for t, r in trace if k * wn / 10 <= t - t0 < (k + 1) * wn / 10] for k in range(10)]
    print("   " + "  ".join(f"{len(b)}/{(sum(b) / len(b) if b else 0):.1f}" for b in tenths))
    out["timeline"] = [[len(b), sum(b)] for b in tenths]
    import resource

    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  peak RSS            {out['peak_rss_mb']:.0f} MB")
    pack = getattr(m.runtime, "autopack", None)  # llm_gemm=auto: the LM's linears packed for batched steps
    if pack is not None:
        out["autopack"] = pack.state
        out["layouts"] = _layouts()
        print(f"  LM linears packed   {pack.state} (auto); layouts kept per rows: {out['layouts']}")
    for part, st in stacked.items():
        print(
            f"  {part} calls stacked  {st['stacked_calls']} of {st['calls']} "
            f"(mean {st['mean_batch']:.2f} calls per run; {st['timed_out']} gathers ran out)"
        )
    m.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "what", nargs="?", choices=["first-audio", "throughput", "_worker"], help="the measurement"
    )
    ap.add_argument("--model", help="a bundle or model dir (full-size CosyVoice2 for the issue's figures)")
    ap.add_argument("--baseline-src", type=Path, help="first-audio: the baseline tree's src folder")
    ap.add_argument("--rounds", type=int, default=15, help="first-audio: interleaved pairs (default 15)")
    ap.add_argument("--concurrency", type=int, default=8, help="throughput: requests at once (default 8)")
    ap.add_argument("--text", default=None, help="the text of every request")
    ap.add_argument("--stream", action="store_true", help="throughput: streamed requests")
    ap.add_argument(
        "--prime",
        action="store_true",
        help="throughput: one concurrent burst first, not measured (llm_gemm=auto packs for batches after it)",
    )
    ap.add_argument(
        "--batch-flow", action="store_true", help="throughput: stack token2wav calls across requests"
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="throughput: the LM's rows per step (default: the runtime's)",
    )
    ap.add_argument(
        "--runtime",
        choices=["torch", "lite"],
        default=None,
        help="the runtime (default: the runtime setting)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="both measurements, 2 pairs, on a tiny CosyVoice2 model (CI; --model: this one)",
    )
    ap.add_argument(
        "--gather-ms",
        type=float,
        default=None,
        help="throughput --batch-flow: how long a stacked call waits for partners (default: the runtime's)",
    )
    ap.add_argument(
        "--flow-context",
        type=float,
        default=0.0,
        help="throughput: flow_context_seconds, the streams' bounded flow context (default 0: exact)",
    )
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    text = args.text or (DRY_TEXT if args.dry_run else TEXT)
    if args.what == "_worker":
        worker(args.model, text, args.batch_size, args.runtime)
        return 0
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="cosyserve-lm-batching-") as tmp:
        model = args.model
        if args.dry_run and model is None:
            from cosyserve.families.testmodel import make_test_model

            model = str(Path(tmp) / "cv2")
            make_test_model(Path(model), size="tiny", seed=0, family="cosyvoice2")
        elif model is None:
            ap.error("--model is needed (or --dry-run)")
        if args.what in (None, "first-audio"):
            base = args.baseline_src or (SRC if args.dry_run else None)
            if base is None:
                ap.error("first-audio needs --baseline-src (the src folder of the tree to compare with)")
            rounds = 2 if args.dry_run else args.rounds
            results["first_audio"] = first_audio(model, base, rounds, text, args.runtime)
        if args.what in (None, "throughput"):
            n = 2 if args.dry_run else args.concurrency
            results["throughput"] = throughput(
                model, n, text, args.stream, args.batch_flow, args.gather_ms, args.batch_size, args.runtime,
                args.flow_context, args.prime,
            )  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
