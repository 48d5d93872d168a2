"""The start path's helpers: the garbage-collector hold, the trimmed warm-up, the text tier, the early readahead."""

import os
import threading
from pathlib import Path

import pytest

from cosyserve.bundle.convert import convert
from proc_util import run_python


@pytest.fixture(scope="module")
def bundle_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(tiny_model_dir, tmp_path_factory.mktemp("bundles") / "tiny", progress=False)


def test_gc_hold_nests_then_freezes_and_restores() -> None:
    """If this fails, a start leaves the garbage collector off for good (cycles leak in a server), turns it on
    for a program that had it off, or stops holding it while an outer hold is still open."""
    code = """
import gc
from cosyserve.system.gchold import gc_held, hold_gc, release_gc
assert gc.isenabled() and gc.get_freeze_count() == 0
hold_gc()
with gc_held():
    assert not gc.isenabled()
assert not gc.isenabled(), "the inner release ended the outer hold"
release_gc()
assert gc.isenabled() and gc.get_freeze_count() > 0, "the last release neither froze nor re-enabled"
release_gc()  # one too many: nothing happens
assert gc.isenabled()
gc.disable()
with gc_held():
    pass
assert not gc.isenabled(), "a hold turned on a collector the program had turned off"
"""
    r = run_python(code)
    assert r.returncode == 0, r.stderr


def test_load_leaves_gc_on_and_what_it_built_frozen(bundle_dir: Path) -> None:
    """If this fails, cosyserve.load leaves the collector off (or never freezes its modules, so every later full
    collection walks them on the request path)."""
    code = f"""
import gc, cosyserve
m = cosyserve.load({str(bundle_dir)!r}, warmup=False)
assert gc.isenabled() and gc.get_freeze_count() > 0
"""
    r = run_python(code)
    assert r.returncode == 0, r.stderr


def test_one_layer_per_stack_trims_a_copy_and_leaves_the_model_whole(bundle_dir: Path) -> None:
    """If this fails, the warm-up runs every layer (slow start), or cuts the stacks of the model that serves
    requests (the flow warms up after READY, while requests may run)."""
    import cosyserve
    from cosyserve.models import one_layer_per_stack

    m = cosyserve.load(bundle_dir, warmup=False)
    llm, flow = m.runtime.pipeline.llm, m.runtime.pipeline.token2wav.flow
    stacks = [
        (mod, path, len(mod.get_submodule(path))) for mod in (llm, flow) for path in type(mod).REPEATED_STACKS
    ]
    assert all(n >= 1 for _, _, n in stacks) and any(n > 1 for _, _, n in stacks)
    for mod in (llm, flow):
        trimmed = one_layer_per_stack(mod)
        for path in type(mod).REPEATED_STACKS:
            assert len(trimmed.get_submodule(path)) == 1
            assert trimmed.get_submodule(path)[0] is mod.get_submodule(path)[0]  # shared, not copied
        assert dict(trimmed.named_parameters()).keys() <= dict(mod.named_parameters()).keys()
    assert all(len(mod.get_submodule(path)) == n for mod, path, n in stacks)
    assert (
        one_layer_per_stack(m.runtime.pipeline.token2wav.hift) is not m.runtime.pipeline.token2wav.hift
    )  # no stacks: a copy


def test_warm_up_does_not_change_the_audio(bundle_dir: Path) -> None:
    """If this fails, the warm-up leaves state behind (a trimmed stack, a cache, a generator) that changes what
    the first request hears."""
    import cosyserve

    warm = cosyserve.load(bundle_dir, warmup=True)
    assert warm.runtime.pipeline.llm.cache_shape() == (0, 0), (
        "the warm-up left its (one-layer) KV caches behind"
    )
    warm.runtime.warmup_thread.join(60)  # the flow and the vocoder warm up after READY
    assert warm.clock.durations["warmup"] > 0 and warm.clock.durations["warmup_token2wav"] > 0
    cold = cosyserve.load(bundle_dir, warmup=False)
    assert cold.runtime.warmup_thread is None
    spk = cold.speakers[0]
    a = warm.synthesize_all("Hello there, one two.", spk, seed=3)
    b = cold.synthesize_all("Hello there, one two.", spk, seed=3)
    assert a.size > 0 and (a == b).all()

    # a request may run while the flow and the vocoder warm up: it must hear the whole model
    stop = threading.Event()

    def warm_again() -> None:
        while not stop.is_set():
            warm.runtime.warm_up_token2wav()

    t = threading.Thread(target=warm_again)
    t.start()
    try:
        c = warm.synthesize_all("Hello there, one two.", spk, seed=3)
    finally:
        stop.set()
        t.join(60)
    assert (c == b).all()


def test_text_tier_loads_after_ready_by_default_and_lazily_when_asked(bundle_dir: Path) -> None:
    """If this fails, the tokenizer or the text normalisers are on the start path (READY later) or, by default,
    left for the first request to build (~0.3 s added to it)."""
    # one fresh process: lazy first (nothing of the text tier imported or built yet), then the default, whose
    # background thread must build what the lazy load left alone
    code = f"""
import os, sys, cosyserve
from cosyserve.frontend import text
os.environ["COSYSERVE_TEXT_TIER"] = "lazy"
m = cosyserve.load({str(bundle_dir)!r}, warmup=True)
from cosyserve.frontend import tokenizer
assert m.runtime.text_thread is None and "wetext" not in sys.modules
assert tokenizer._shared.cache_info().currsize == 0, "the tokenizer was built on the start path"
m.close()
del os.environ["COSYSERVE_TEXT_TIER"]
m = cosyserve.load({str(bundle_dir)!r}, warmup=True)
m.runtime.text_thread.join(60)
assert text.normalizers_loaded() and m.clock.durations["text_tier"] > 0
assert tokenizer._shared.cache_info().currsize == 1
# the start times say so too (the waterfalls draw from them): the text tier starts after READY
starts, ready = m.clock.as_dict()["starts_ms"], m.clock.points["ready"]
assert starts["imports"] < starts["warmup"] < ready <= starts["text_tier"], (starts, ready)
"""
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    r = run_python(f"import cosyserve; cosyserve.load({str(bundle_dir)!r})", COSYSERVE_TEXT_TIER="eager")
    assert r.returncode != 0 and "COSYSERVE_TEXT_TIER" in r.stderr


def test_prefetch_reads_bundle_files_into_the_page_cache(
    bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If this fails, the early readahead reads nothing, and a cold start waits for the disk after importing
    torch instead of during it."""
    from cosyserve.system.pagecache import evict, prefetch_bundles, prefetch_files, resident_bytes

    big = tmp_path / "weights.safetensors"
    big.write_bytes(os.urandom(8 << 20))
    evict([big])
    if resident_bytes([big]) > 0:
        pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED (tmpfs?)")
    threads = prefetch_files([big, tmp_path / "missing.safetensors"], piece=1 << 20)
    for t in threads:
        t.join(30)
    assert resident_bytes([big]) == big.stat().st_size
    assert prefetch_bundles([str(tmp_path)]) == []  # not a bundle: no manifest.json
    assert prefetch_bundles([str(bundle_dir)], "lazy") == []  # lazy: pages come when used
    threads = prefetch_bundles([str(bundle_dir)], "preload")
    assert threads
    for t in threads:
        t.join(30)
    files = sorted(bundle_dir.glob("*.safetensors"))
    assert resident_bytes(files) >= sum(f.stat().st_size for f in files)  # whole pages


def test_populate_maps_every_page(bundle_dir: Path) -> None:
    """If this fails, preload leaves the weights' pages to fault in on the first request (populate maps nothing,
    or its ctypes madvise call is wrong)."""
    from cosyserve.bundle.mmap_safetensors import MappedFile

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    f = MappedFile(bundle_dir / "llm.safetensors")
    before = rss()
    f.populate()
    assert rss() - before >= 0.9 * f.size


def test_row_tables_are_exactly_the_embedding_tables(bundle_dir: Path) -> None:
    """If this fails, a model's ROW_TABLES names a tensor that is not an embedding table (preload would leave
    weights that every request reads in bulk to fault in) or misses one (its unused rows cost memory)."""
    from torch import nn

    import cosyserve

    m = cosyserve.load(bundle_dir, warmup=False)
    p = m.runtime.pipeline
    for module in (p.llm, p.token2wav.flow, p.token2wav.hift):
        tables = {f"{n}.weight" for n, sub in module.named_modules() if isinstance(sub, nn.Embedding)}
        assert set(getattr(module, "ROW_TABLES", ())) == tables, type(module).__name__


def test_populate_leaves_row_tables_cached_but_unmapped(tmp_path: Path) -> None:
    """If this fails, preload maps a whole embedding table (212 MB for CosyVoice-300M's text vocabulary, of which
    a request reads a few rows), or leaves it to be read from disk on the request path."""
    import torch
    from safetensors.torch import save_file

    from cosyserve.bundle.mmap_safetensors import MappedFile
    from cosyserve.system.pagecache import evict, resident_bytes, rss_of_files

    path = tmp_path / "w.safetensors"
    save_file(
        {"a.weight": torch.ones(1 << 20), "emb.weight": torch.ones(2 << 20), "z.bias": torch.ones(1 << 19)},
        path,
    )
    evict([path])
    f = MappedFile(path)
    spans = f.spans({"emb.weight"})
    hole = [(b, e) for b, e, mapped in spans if not mapped]
    info = f.tensors["emb.weight"]
    assert len(hole) == 1 and info.begin <= hole[0][0] < hole[0][1] <= info.end
    assert hole[0][1] - hole[0][0] >= (8 << 20) - 2 * os.sysconf("SC_PAGE_SIZE")
    assert [s[:2] for s in spans] == sorted(s[:2] for s in spans) and spans[-1][1] == f.size

    f.populate({"emb.weight"})
    assert resident_bytes([path]) >= f.size - os.sysconf("SC_PAGE_SIZE")  # all of it in the page cache
    mapped = rss_of_files([path])
    assert f.size - (8 << 20) - (1 << 20) <= mapped <= f.size - (8 << 20) + (1 << 20), mapped
    row = f.tensor("emb.weight")[12345]  # a row faults in when read
    assert float(row) == 1.0


# -- the start-up waterfall SVG (cosyserve startup-report --svg) ---------------------------------------------

EM = 0.6  # a sans-serif character's advance in ems, about (DejaVu Sans / Arial average); bold a little wider


def _summary(
    phases: dict[str, float], starts: dict[str, float], ready: float, floor: float, first: float
) -> dict:
    def st(v: float) -> dict[str, float]:
        return {"min": v, "median": v, "max": v}

    return {
        "runs": 5,
        "cold": False,
        "strategy": "preload",
        "ready_ms": st(ready),
        "floor_ms": st(floor),
        "first_audio_ms": st(first),
        "ratio_ready_to_floor": ready / floor,
        "phases_ms": {k: st(v) for k, v in phases.items()},
        "phase_starts_ms": {k: st(v) for k, v in starts.items()},
    }


# imports dominate; floor, READY and first audio lie within 40 ms of each other; one phase takes 0.01 ms
_PHASES = {"interpreter": 22, "imports": 1150, "manifest": 3, "construct": 60, "map_assign": 25, "verify": 0.01,
           "first_touch": 40, "warmup": 90, "text_tier": 320, "warmup_token2wav": 110}  # fmt: skip
_STARTS = {"interpreter": 0, "imports": 25, "manifest": 1180, "construct": 1185, "map_assign": 1190, "verify": 1245,
           "first_touch": 1246, "warmup": 1290, "text_tier": 1382, "warmup_token2wav": 1702}  # fmt: skip


@pytest.mark.parametrize(
    "summary",
    [
        _summary(_PHASES, _STARTS, ready=1381, floor=1370, first=1420),
        _summary(_PHASES, {}, ready=1381, floor=1379, first=1384),  # no start times: back to back
        _summary({**_PHASES, "imports": 60_000}, {}, ready=61_400, floor=61_390, first=61_390),
    ],
    ids=["starts", "back-to-back", "one-minute-import"],
)
def test_waterfall_svg_is_legible(summary: dict, tmp_path: Path) -> None:
    """The waterfall must read at a glance: no two labels overlap (floor, READY and first audio are close by
    design), every label lies inside the picture, every phase bar is visible however short next to a dominant
    one, and the phases that run after READY are drawn after the READY line."""
    import xml.etree.ElementTree as ET

    from cosyserve.tools.report import _svg

    path = tmp_path / "w.svg"
    _svg(summary, path)
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    width, height = float(root.get("width")), float(root.get("height"))  # type: ignore[arg-type]
    font = float(root.get("font-size", "12"))
    boxes = []
    for t in root.iter(ns + "text"):
        size = float(t.get("font-size", font))
        w = len(t.text or "") * size * (EM + (0.05 if t.get("font-weight") == "bold" else 0.0))
        x, y = float(t.get("x")), float(t.get("y"))  # type: ignore[arg-type]
        x0 = {"start": x, "middle": x - w / 2, "end": x - w}[t.get("text-anchor", "start")]
        boxes.append((t.text, x0, y - size, x0 + w, y + 0.25 * size))
    texts = [b[0] for b in boxes]
    assert any(s.startswith("floor") for s in texts) and any(s.lower().startswith("ready ") for s in texts), (
        texts
    )
    assert any(s.startswith("first audio") for s in texts), texts
    for s, x0, y0, x1, y1 in boxes:
        assert 0 <= x0 and x1 <= width and 0 <= y0 and y1 <= height, f"{s!r} leaves the picture"
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            apart = a[3] <= b[1] or b[3] <= a[1] or a[4] <= b[2] or b[4] <= a[2]
            assert apart, f"labels {a[0]!r} and {b[0]!r} overlap"
    bars = {r.find(ns + "title").text: r for r in root.iter(ns + "rect") if r.get("class") == "phase"}  # type: ignore[union-attr]
    assert set(bars) == set(summary["phases_ms"]), "a phase has no bar"
    for name, r in bars.items():
        assert float(r.get("width")) >= 3, f"{name}'s bar is too thin to see"  # type: ignore[arg-type]
        assert 0 <= float(r.get("x")) and float(r.get("x")) + float(r.get("width")) <= width  # type: ignore[arg-type]
    marks = {m.find(ns + "title").text: float(m.get("x1")) for m in root.iter(ns + "line")}  # type: ignore[union-attr,arg-type]
    ready = marks.get("READY")
    for name in ("text_tier", "warmup_token2wav"):
        assert ready is not None and float(bars[name].get("x")) >= ready, (
            f"{name} runs after READY, drawn before"
        )  # type: ignore[arg-type]
    assert float(bars["warmup"].get("x")) < ready  # type: ignore[arg-type]
