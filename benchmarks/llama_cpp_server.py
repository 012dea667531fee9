"""llama.cpp's `llama-server`, built once from the `llama-cpp-python` source distribution on PyPI,
for side-by-side runs on the same workload (benchmarks/serve_throughput.py --llama-cpp).

The sdist vendors llama.cpp; the server is built with cmake into SHOAL_CACHE_DIR/llama.cpp/<version>
(about 15 minutes on 2 cores, once). GGML_NATIVE tunes it for the CPU it is built on, as a user
building llama.cpp would: a cache copied to another CPU must be rebuilt (the key names the CPU).

    python benchmarks/llama_cpp_server.py build       # prints the binary's path
    python benchmarks/llama_cpp_server.py serve --port 8124
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

from shoal.cache_dir import cache_root
from shoal.kernels.build import cpu_model_name
from shoal.models.checkpoint import bundled_model_path

VERSION = "0.3.36"  # llama-cpp-python; pinned so that figures name the llama.cpp they measured


def build_dir(version: str = VERSION) -> Path:
    root = cache_root() or Path(tempfile.gettempdir()) / "shoal"
    cpu = hashlib.sha256(cpu_model_name().encode()).hexdigest()[:8]
    return root / "llama.cpp" / f"{version}-{cpu}"


def build(version: str = VERSION, jobs: int | None = None) -> Path:
    """The path of `llama-server`, building it first when the cache lacks it."""
    out = build_dir(version)
    binary = out / "llama-server"
    if binary.exists():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"building llama.cpp needs {tool}")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", tmp],
            check=True,
        )  # fmt: skip
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        bld = Path(tmp) / "build"
        subprocess.run(
            ["cmake", "-S", str(src), "-B", str(bld), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
             "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
             "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"],
            check=True,
        )  # fmt: skip
        subprocess.run(
            [
                "cmake",
                "--build",
                str(bld),
                "--target",
                "llama-server",
                "-j",
                str(jobs or os.cpu_count() or 2),
            ],
            check=True,
        )
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(next(bld.rglob("bin/llama-server")), binary)
    return binary


def wait_until_ok(url: str, proc: subprocess.Popen, name: str, timeout: float) -> None:
    """Polls `url` until it answers 200; exits if `proc` dies first or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited early with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"{name} did not become ready")


@contextlib.contextmanager
def serve(port: int, slots: int = 32, ctx_per_slot: int = 256, threads: int | None = None):
    """`llama-server` on the bundled GGUF as stored, `slots` parallel sequences; yields its URL."""
    binary = build()
    cmd = [
        str(binary), "-m", str(bundled_model_path()), "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(slots), "--ctx-size", str(slots * ctx_per_slot), "--cont-batching",
        "--threads", str(threads or os.cpu_count() or 2), "--no-webui",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ok(url + "/health", proc, "llama-server", timeout=120)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=["build", "serve"])
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--slots", type=int, default=32)
    args = ap.parse_args()
    if args.action == "build":
        print(build())
        return
    with serve(args.port, args.slots) as url:
        print(f"llama-server ready at {url}; Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


if __name__ == "__main__":
    main()
