"""The C kernels' structs as the compiler lays them out against Python's ctypes mirror of them."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys

import pytest

from shoal.kernels.abi import (
    CPU_CONSTANTS,
    CPU_STRUCTS,
    SHM_STRUCTS,
    LayerParams,
    ProjectionParams,
    abi_mismatches,
    open_checked,
)
from shoal.kernels.build import SHM_SOURCES, cpu_library_path, load_cpu_library, load_shm_library

needs_kernels = pytest.mark.skipif(load_cpu_library() is None, reason="no CPU kernels here")


class DriftedLayerParams(ctypes.Structure):
    """LayerParams as it would read had C's eps become a double and Python not followed."""

    _fields_ = [(name, ctypes.c_double if name == "eps" else ctype) for name, ctype in LayerParams._fields_]


class ShortLayerParams(ctypes.Structure):
    """LayerParams missing C's last field."""

    _fields_ = LayerParams._fields_[:-1]


@needs_kernels
def test_both_libraries_lay_out_what_python_builds():
    assert abi_mismatches(load_cpu_library(), CPU_STRUCTS, CPU_CONSTANTS) == []
    if load_shm_library() is not None:
        assert abi_mismatches(load_shm_library(), SHM_STRUCTS) == []


@needs_kernels
def test_a_drifted_struct_is_found_and_the_library_refused(caplog):
    lib = load_cpu_library()
    drifted = abi_mismatches(lib, {"LayerParams": DriftedLayerParams})
    assert any(p.startswith("LayerParams: ") and "bytes in C" in p for p in drifted)
    assert any(p.startswith("LayerParams.eps: ") for p in drifted)
    assert any(p.startswith("LayerParams.scale: ") for p in drifted)  # every later field moved
    short = abi_mismatches(lib, {"LayerParams": ShortLayerParams, "ProjectionParams": ProjectionParams})
    assert "LayerParams: 20 fields in C, 19 in Python" in short
    assert abi_mismatches(lib, {}, {**CPU_CONSTANTS, "KV_BF16": 7}) == ["KV_BF16: 2 in C, 7 in Python"]
    assert open_checked(str(cpu_library_path()), {"LayerParams": DriftedLayerParams}) is None
    assert "refusing" in caplog.text and "LayerParams.eps" in caplog.text


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_a_library_that_does_not_describe_itself_is_refused(tmp_path):
    """A library built before the ABI check (or without abi.c) says nothing of its layout."""
    path = tmp_path / "libold.so"
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", path, str(SHM_SOURCES[0])], check=True)
    assert abi_mismatches(ctypes.CDLL(str(path)), SHM_STRUCTS) == [
        "the library does not describe its ABI (built from older sources)"
    ]
    assert open_checked(str(path), SHM_STRUCTS) is None


REFUSED = """
import ctypes
import shoal.kernels.abi as abi
class LayerParams(ctypes.Structure):
    _fields_ = [(n, ctypes.c_double if n == "eps" else t) for n, t in abi.LayerParams._fields_]
abi.CPU_STRUCTS["LayerParams"] = LayerParams  # before anything loads the library
from shoal.engine.model_runner import ModelRunner
from shoal.kernels.cpu import cpu_kernels
from tests.test_cpu_decode import random_model
assert cpu_kernels() is None
runner = ModelRunner(random_model("int8", head_dim=64), num_blocks=8, block_size=4, eos_token_ids=frozenset())
assert runner.fused_decoder is None and type(runner.attention).__name__ == "TorchPagedAttention"
print("torch")
"""


@needs_kernels
def test_an_engine_whose_kernels_do_not_match_runs_on_torch():
    out = subprocess.run([sys.executable, "-c", REFUSED], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "torch"
    assert "refusing" in out.stderr and "LayerParams.eps" in out.stderr
