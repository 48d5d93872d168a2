"""One measured start, run as a fresh process by ``cosyserve startup-report`` (not a public entry point).

Loads the model exactly as ``cosyserve.load`` does for a server, runs one streaming request, and prints one
JSON line with the phase timings (same PhaseClock the server exposes), the first-audio point and peak RSS.
"""

import time

T_MAIN = time.time()

import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402


def main(argv: list[str]) -> None:
    from cosyserve.core.clock import PhaseClock
    from cosyserve.system.gchold import hold_gc, release_gc
    from cosyserve.system.pagecache import prefetch_bundles

    hold_gc()  # as `cosyserve serve` does from process start to READY
    opts = json.loads(argv[0])
    if opts.get("strategy") != "lazy":
        prefetch_bundles([opts["model"]], runtime=opts.get("runtime") or "torch")  # as `cosyserve serve` does
    clock = PhaseClock()
    clock.add("interpreter", (T_MAIN - clock.t0) * 1e3, start_ms=0.0)
    import cosyserve

    model = cosyserve.load(
        opts["model"],
        strategy=opts.get("strategy"),
        warmup=opts.get("warmup", True),
        threads=opts.get("threads"),
        clock=clock,
        runtime=opts.get("runtime"),
    )
    release_gc()
    speaker = model.speakers[0] if model.speakers else None
    first_audio = None
    if speaker is not None:
        stream = model.synthesize(
            opts.get("text", "Hello world, this is a test."), speaker, stream=True, seed=0
        )
        next(stream)
        first_audio = clock.mark("first_audio")
        stream.close()
    model.runtime.join_background()  # what loads after READY (the zero-shot tier's sessions among it) counts
    out = clock.as_dict()
    out["first_audio_ms"] = first_audio
    out["precision"] = model.runtime.precision
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("COSYSERVE_PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
