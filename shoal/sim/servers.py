"""Processes of this host for the profiler's timed runs: a `shoal` server on a free port, placed
on the cores a fleet would give it, an engine in a fresh interpreter, and the CPU a process
spends."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time


def spawn_shoal(
    command: list[str],
    env: dict[str, str] | None = None,
    stdout=subprocess.DEVNULL,
    cpus: list[int] | None = None,
) -> tuple[str, subprocess.Popen, tempfile.TemporaryDirectory]:
    """`shoal COMMAND` started on a free port: its URL, its process and its state folder, which the
    caller removes once the process is gone. A gateway keeps its batch jobs and usage per port
    under the state root; one on a port of the moment keeps them in a folder of its own. `cpus`:
    the cores it is pinned to (from before it execs, as a fleet's launcher pins a replica)."""
    from shoal.fleet.control.launchers.local import free_port

    port = free_port()
    pin = cpus if cpus and hasattr(os, "sched_setaffinity") else None
    state = tempfile.TemporaryDirectory(prefix="shoal-state-", ignore_cleanup_errors=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", *command, "--port", str(port)],
        env={**os.environ, "SHOAL_STATE_DIR": state.name, **(env or {})},
        stdout=stdout,
        stderr=subprocess.STDOUT,  # with stdout, wherever that goes
        preexec_fn=(lambda: os.sched_setaffinity(0, pin)) if pin else None,
    )
    return f"http://127.0.0.1:{port}", proc, state


@contextlib.contextmanager
def running(
    command: list[str], env: dict[str, str] | None = None, poll_s: float = 0.25, cpus: list[int] | None = None
):
    """`shoal COMMAND` on a free port, ready: its URL and process; stopped at the exit, its state
    folder removed (spawn_shoal)."""
    url, proc, state = spawn_shoal(command, env, cpus=cpus)
    try:
        wait_for(url, proc, poll_s=poll_s)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(60)
        state.cleanup()


def fleet_placement(serve_flags: list[str]) -> tuple[dict | None, list[int] | None, list[int]]:
    """The thread variables and cores a fleet gives a replica of these flags (with `--threads N`
    below the host's cores: N threads pinned to the last N; else neither), and the host's other
    cores."""
    from shoal.fleet.control.cores import host_cpus, thread_env, threads_flag

    threads, cpus = threads_flag(serve_flags), host_cpus()
    if threads is None or threads >= len(cpus):
        return None, None, []
    return thread_env(threads), cpus[-threads:], cpus[:-threads]


def wait_for(url: str, proc: subprocess.Popen, timeout: float = 300, poll_s: float = 0.25) -> None:
    """Polls `url`/ready through one client, as a gateway probes: httpx.get builds a client, and
    its TLS context, on each call (50 ms of CPU here), which at a start-up timer's pace took half
    a core from the server it timed and made its start read 0.5-2 s slow."""
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"shoal serve exited with {proc.returncode} before it was ready")
            try:
                if client.get(url + "/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
    raise RuntimeError(f"shoal serve was not ready within {timeout:.0f} s")


def in_fresh_engine(then: str, engine_options: dict, *args: str) -> str:
    """Builds `llm = LLM(**engine_options)` in a new interpreter and runs the code `then` after it
    (its sys.argv[2:] are `args`); returns what it printed."""
    code = f"import json, sys; from shoal.llm import LLM; llm = LLM(**json.loads(sys.argv[1])); {then}"
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(engine_options), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the engine in a fresh process failed: {proc.stderr.strip()[-400:]}")
    return proc.stdout


class ProcessCPU:
    """The CPU seconds (user and system) a process of this host has spent so far; `name` says
    which process, should it have ended when read."""

    def __init__(self, pid: int, name: str):
        import psutil

        self.proc, self.name = psutil.Process(pid), name

    def seconds(self) -> float:
        import psutil

        try:
            t = self.proc.cpu_times()
        except psutil.Error as exc:
            raise RuntimeError(f"{self.name} (pid {self.proc.pid}) ended: {exc}") from exc
        return t.user + t.system
