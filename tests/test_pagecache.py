"""The page-cache helpers that the start path, the loader, the report and the pool share."""

import mmap
import os
from pathlib import Path

import pytest

from cosyserve.system import pagecache

PAGE = mmap.PAGESIZE


def test_missing_ranges_are_the_uncached_runs_cut_into_pieces() -> None:
    """If this fails, read-ahead reads pages that are already cached (wasted disk time on a warm start), skips
    pages that are not (the request path reads them), or runs past the end of the file."""
    resident = bytes([1, 0, 0, 1, 0, 0, 0, 1, 0])
    begin, end = 4 * PAGE, 4 * PAGE + 8 * PAGE + 100  # the last page is partial
    assert pagecache.missing_ranges(resident, begin, end) == [
        (begin + PAGE, begin + 3 * PAGE),
        (begin + 4 * PAGE, begin + 7 * PAGE),
        (begin + 8 * PAGE, end),
    ]
    assert pagecache.missing_ranges(resident, begin, end, piece=2 * PAGE) == [
        (begin + PAGE, begin + 3 * PAGE),
        (begin + 4 * PAGE, begin + 6 * PAGE),
        (begin + 6 * PAGE, begin + 7 * PAGE),
        (begin + 8 * PAGE, end),
    ]
    assert pagecache.missing_ranges(b"\1\1", 0, 2 * PAGE) == []


def test_read_ranges_counts_bytes_and_reports_or_skips_errors(tmp_path: Path) -> None:
    """If this fails, a failed read into the page cache is lost where the caller asked to hear of it (the loader's
    row tables), or stops read-ahead where it should only skip the file (a start's prefetch)."""
    a = tmp_path / "a"
    a.write_bytes(os.urandom(3 * PAGE + 7))
    ranges = [(a, 0, PAGE), (a, PAGE, 10 * PAGE), (tmp_path / "missing", 0, PAGE)]
    assert pagecache.read_ranges(ranges, workers=2, block=PAGE, ignore_errors=True) == 3 * PAGE + 7
    with pytest.raises(FileNotFoundError):
        pagecache.read_ranges(ranges, workers=2, block=PAGE)


def test_populate_and_touch_map_the_pages_in(tmp_path: Path) -> None:
    """If this fails, preload leaves pages to fault in on the request path (populate or its fallback maps
    nothing) or touch reads past the range it was given."""
    path = tmp_path / "w"
    path.write_bytes(os.urandom(64 * PAGE))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        before = pagecache.rss_of_files([path])
        pagecache.populate(mm, 0, 32 * PAGE)
        assert pagecache.rss_of_files([path]) - before >= 32 * PAGE
        assert pagecache.touch(mm, 32 * PAGE, 40 * PAGE) == 8 * PAGE
        assert pagecache.resident_map(mm, 0, 40 * PAGE) == b"\1" * 40
    finally:
        mm.close()


def test_populate_mapped_maps_in_another_librarys_mappings_of_a_file(tmp_path: Path) -> None:
    """If this fails, the lite runtime's start leaves its LM step weights (mapped by ONNX Runtime, not by us) to
    fault in on a first request, or maps in a file it was not asked for."""
    path, other = tmp_path / "w", tmp_path / "other"
    path.write_bytes(os.urandom(64 * PAGE))
    other.write_bytes(os.urandom(8 * PAGE))
    with open(path, "rb") as f, open(other, "rb") as g:
        mm = mmap.mmap(
            f.fileno(), 0, access=mmap.ACCESS_READ
        )  # read-only and never touched: nothing resident
        mo = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if pagecache.rss_of_files([path]) != 0:
            pytest.skip("this kernel maps a fresh mapping's pages in at mmap time")
        try:
            mapped = pagecache.populate_mapped(path)
        except OSError as e:
            pytest.skip(f"no MADV_POPULATE_READ here ({e})")
        assert mapped == 64 * PAGE
        assert pagecache.rss_of_files([path]) == 64 * PAGE
        assert pagecache.rss_of_files([other]) == 0
        assert pagecache.populate_mapped(tmp_path / "not-mapped") == 0
    finally:
        mm.close()
        mo.close()


def test_memory_probes_report_sane_figures() -> None:
    """If this fails, the pool's pressure rule reads nonsense (a limit of 0, usage above the limit)."""
    used, limit = pagecache.memory_usage()
    assert 0 < used < limit
    assert pagecache.memory_limit_bytes() > 0
    assert pagecache.rss_of_files([]) == 0
