"""Kernel crossovers: measured on the CPU at hand, cached per CPU and thread count, and obeyed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shoal.kernels.cpu import cpu_kernels
from shoal.kernels.tuning import ROWS, KernelChoices, _crossover, _record_path


def test_crossover_is_where_torch_wins_from_then_on():
    c = {r: 10.0 for r in ROWS}
    assert _crossover(c, {r: 20.0 for r in ROWS}) is None
    assert _crossover(c, {r: 5.0 for r in ROWS}) == ROWS[0]
    # A win that does not last (noise at one size) is no crossover.
    assert _crossover(c, {r: 5.0 if r == 16 else 20.0 for r in ROWS}) is None
    assert _crossover(c, {r: 5.0 if r >= 64 else 20.0 for r in ROWS}) == 64
    # A tie, or a win inside the timing's noise, is not one: the C paths fuse more than the matmul.
    assert _crossover(c, {r: 9.8 for r in ROWS}) is None
    assert _crossover(c, {r: 9.8 if r < 8 else 5.0 for r in ROWS}) == 8
    choices = KernelChoices(int8_torch_from_rows=64, f32_torch_from_rows=None)
    assert not choices.int8_uses_torch(63) and choices.int8_uses_torch(64)
    assert not choices.f32_uses_torch(10**6)


def test_a_fused_calls_crossover_is_timed_once_per_shape_and_thread_count():
    """The C side costs 0.1 ms a row, torch's 0.5 ms whatever the rows: torch wins from 16 of
    (1, 4, 16, 64); the same key again is not timed again."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no CPU kernels here")
    timed = []

    def calls_at(n):
        timed.append(n)
        return (lambda: time.sleep(1e-4 * n)), (lambda: time.sleep(5e-4))

    key = ("test_sleeps", time.time_ns())
    assert kernels.tuner.fused_crossover(key, calls_at, (1, 4, 16, 64)) == 16
    assert timed == [1, 4, 16, 64]
    assert kernels.tuner.fused_crossover(key, calls_at, (1, 4, 16, 64)) == 16
    assert timed == [1, 4, 16, 64]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before > 1 else 2)
        kernels.tuner.fused_crossover(key, calls_at, (1, 4))
        assert timed == [1, 4, 16, 64, 1, 4]
    finally:
        torch.set_num_threads(before)


_MEASURE = """
import json, sys, time
from shoal.kernels.cpu import cpu_kernels
from shoal.kernels.tuning import _record_path
t0 = time.perf_counter()
c = cpu_kernels().choices
print(json.dumps({"path": str(_record_path()), "s": time.perf_counter() - t0, "summary": c.summary(),
                  "timings": c.timings_us}))
"""


def _measure_in_child(cache, threads: int) -> dict:
    env = {"SHOAL_CACHE_DIR": str(cache), "OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_choices_are_measured_once_per_cpu_and_thread_count(tmp_path):
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    first = _measure_in_child(tmp_path, 1)
    record = json.loads(Path(first["path"]).read_text())
    # Every path was timed at every row count on this CPU (torch._int_mm only past 16 rows).
    assert set(record["timings_us"]) == {"int8_c", "int8_torch", "f32_c", "f32_torch"}
    assert all(len(t) == len(ROWS) for t in record["timings_us"].values())
    assert record["threads"] == 1
    print("\n" + first["summary"])
    # The second start reads the record instead of measuring: the same answer, with no timing.
    again = _measure_in_child(tmp_path, 1)
    assert again["path"] == first["path"] and again["timings"] == first["timings"]
    # Another thread count is another measurement, in its own record.
    other = _measure_in_child(tmp_path, 2)
    assert other["path"] != first["path"]
    # A damaged record is measured again, not trusted.
    Path(first["path"]).write_text("{not json")
    redone = _measure_in_child(tmp_path, 1)
    assert json.loads(Path(redone["path"]).read_text())["threads"] == 1


def test_record_path_names_the_library_cpu_and_threads(monkeypatch, tmp_path):
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _record_path()
        torch.set_num_threads(2)
        two = _record_path()
    finally:
        torch.set_num_threads(before)
    assert one != two and one.parent == two.parent
