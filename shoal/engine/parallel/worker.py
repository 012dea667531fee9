"""One rank of a tensor- or pipeline-parallel model: connects to the driver, joins the
torch.distributed group, loads its slices of the weights, then runs each step it is sent.

Started by the driver on its own host (`python -m shoal.engine.parallel.worker`), or by hand on
another host (`shoal worker --driver HOST:PORT --rank R`, with the driver's SHOAL_WORKER_AUTHKEY).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from pathlib import Path

import torch
import torch.distributed as dist

from shoal.cache_dir import cache_root
from shoal.engine.parallel.addresses import DriverLink, address_towards, interface_of
from shoal.engine.parallel.comm import CommError, StageLink, tp_communicator
from shoal.engine.parallel.messages import RankPlace, RankStats, WorkerSetup, rank_threads
from shoal.engine.parallel.model_files import ModelFiles, local_copy, receive
from shoal.engine.parallel.rendezvous import AuthStore
from shoal.engine.runner_setup import DTYPES, build_runner
from shoal.models.loader import load_model
from shoal.models.moe import sparse_layers
from shoal.models.parallel import ModelShard

log = logging.getLogger(__name__)

AUTHKEY_ENV = "SHOAL_WORKER_AUTHKEY"
CONNECT_TIMEOUT_S = 300.0


def _die_with_parent() -> None:
    """A rank started by the driver ends when the driver does, even by kill -9, even while it
    waits in a collective. (Not PR_SET_PDEATHSIG: that fires when the thread that started the
    rank ends, and the driver starts its ranks from a loader thread.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="shoal-parent-watch", daemon=True).start()


class Rank:
    def __init__(self, conn: Connection, place: RankPlace, setup: WorkerSetup, link: DriverLink):
        self.conn = conn
        self.place = place
        config = setup.config
        par = config.parallel
        timeout = timedelta(seconds=par.step_timeout_s)
        # The rendezvous is on the driver's host, at the address this rank reached the driver by
        # (the driver may listen on all addresses).
        # Held for the rank's life: torch keeps only the C++ side, and a collected Python store
        # leaves it calling methods that are no longer there.
        self.store = store = AuthStore(link.driver_host, setup.store_port, link.authkey, timeout)
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            # Gloo binds where the host name resolves, and falls back to loopback where it does
            # not: peers on other hosts would be told 127.0.0.1. Bind where this rank is reached.
            os.environ["GLOO_SOCKET_IFNAME"] = interface_of(link.advertise_host)
        device = torch.device(config.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"no CUDA device on {socket.gethostname()}")
            device = torch.device("cuda", place.rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, store=store, rank=place.rank, world_size=par.world_size, timeout=timeout
        )
        tp, pp = place.tp_size, place.pp_size
        # Every rank creates every group, in the same order, as torch.distributed requires. Each
        # with the step timeout: a group's own default is 30 minutes, which a collective waits for a
        # peer cut off mid-step, long after the driver has given the step up and gone.
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=timeout) for s in range(pp)]
        self.comm = None
        if tp > 1:
            name = f"shoal-{setup.run_id}-stage{place.pp_rank}"
            self.comm = tp_communicator(
                groups[place.pp_rank], tp, place.tp_rank, name, device, par.step_timeout_s
            )
        ep = par.expert_parallel_size > 1
        parallel = (place.tp_rank, tp, place.pp_rank, pp, ep, ep and par.expert_dispatch == "all-to-all")
        loaded = load_model(
            config.model,
            dtype=DTYPES[config.dtype],
            device=device,
            quantization=config.quantization,
            parallel=parallel,
            comm=self.comm,
        )
        shard: ModelShard = loaded.model.shard
        self.stage = None
        if pp > 1:
            prev_rank = place.rank - tp if not shard.is_first_stage else None
            next_rank = place.rank + tp if not shard.is_last_stage else None
            self.stage = StageLink(
                prev_rank, next_rank, loaded.config.hidden_size, loaded.model.dtype, device
            )
        self.runner = build_runner(
            config, loaded, setup.num_blocks, setup.max_model_len, self.stage, device=str(device)
        )
        self.fused = self.runner.fused_decoder is not None
        self.stats = RankStats(place.rank)
        self.moe_layers = sparse_layers(self.runner.model)
        # How this rank's sparse layers reach their experts (None: it holds every expert whole).
        self.expert_dispatch = None
        if self.moe_layers and shard.expert_parallel and tp > 1:
            self.expert_dispatch = "all-to-all" if shard.all_to_all else "all-reduce"

    def _profile(self, step_ns: int) -> RankStats:
        s = self.stats
        s.steps += 1
        s.step_s += step_ns * 1e-9
        if self.comm is not None:
            ns, s.comm_calls = self.comm.busy
            s.comm_s = ns * 1e-9
        if self.stage is not None:
            s.stage_wait_s = self.stage.wait_ns * 1e-9
        if self.moe_layers:
            first = self.runner.model.shard.layers.start
            s.expert_tokens = {first + i: (m.offset, m.expert_load()) for i, m in self.moe_layers.items()}
            s.moe_dispatch_s = sum(m.dispatch_ns for m in self.moe_layers.values()) * 1e-9
            s.moe_combine_s = sum(m.combine_ns for m in self.moe_layers.values()) * 1e-9
        return s

    def serve(self) -> None:
        """Runs steps until told to stop or the driver goes away."""
        while True:
            try:
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return  # the driver is gone
            if msg[0] == "shutdown":
                return
            so = msg[1]
            t0 = time.perf_counter_ns()
            try:
                out = self.runner.execute(so)
            except CommError as exc:
                self._reply(("fatal", f"{type(exc).__name__}: {exc}"))
                return
            except Exception as exc:  # the driver retries the step request by request
                log.exception("rank %d: step %d failed", self.place.rank, so.step_id)
                fatal = self.comm is not None and self.comm.failed
                self._reply(("fatal" if fatal else "error", f"{type(exc).__name__}: {exc}"))
                if fatal:
                    return
                continue
            stats = self._profile(time.perf_counter_ns() - t0)
            self._reply(("ok", out if self.place.answers else None, stats))

    def _reply(self, msg) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(msg)

    def close(self) -> None:
        if self.stage is not None:
            with contextlib.suppress(Exception):
                self.stage.flush()
        if self.comm is not None:
            self.comm.close()
        self.runner.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _connect(driver: str, authkey: bytes, timeout: float) -> Connection:
    """A rank started by hand may come up before its driver listens: it retries for a while."""
    host, port = driver.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client((host, int(port)), authkey=authkey)
        except (ConnectionRefusedError, TimeoutError, OSError) as exc:
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach the driver at {driver}: {exc}") from None
            time.sleep(0.5)


def _model_here(conn: Connection, files: ModelFiles) -> Path:
    """The model on this host: at the driver's path, in this host's cache, or fetched from the
    driver into the cache now."""
    cache = cache_root() or Path(tempfile.mkdtemp(prefix="shoal-model-"))
    local = local_copy(files, cache)
    if local is None:
        log.info("this host lacks %s: fetching it from the driver into %s", files.path, cache)
        conn.send(("fetch",))
        local = receive(conn, files, cache)
    return local


def run_worker(
    driver: str, rank: int, authkey: bytes, spawned: bool, advertise_host: str | None = None
) -> int:
    """`advertise_host`: the address the other ranks reach this one at (default: this host's
    address on the route to the driver)."""
    if spawned:
        _die_with_parent()
    conn = _connect(driver, authkey, CONNECT_TIMEOUT_S)
    driver_host = driver.rsplit(":", 1)[0]
    link = DriverLink(driver_host, authkey, advertise_host or address_towards(driver_host))
    conn.send(("hello", rank, socket.gethostname(), os.getpid()))
    setup: WorkerSetup = conn.recv()
    par = setup.config.parallel
    place = RankPlace(rank, par.tensor_parallel_size, par.pipeline_parallel_size)
    torch.set_num_threads(rank_threads(setup.config))
    try:
        if setup.model is not None:
            setup.config = dataclasses.replace(setup.config, model=str(_model_here(conn, setup.model)))
        worker = Rank(conn, place, setup, link)
    except Exception as exc:
        log.exception("rank %d failed to start", rank)
        with contextlib.suppress(OSError):
            conn.send(("failed", f"rank {rank}: {type(exc).__name__}: {exc}"))
        return 1
    info = {"rank": rank, "fused_decode": worker.fused, "threads": torch.get_num_threads()}
    info["collectives"] = worker.comm.kind if worker.comm is not None else None
    info["expert_dispatch"] = worker.expert_dispatch
    info["host"], info["address"] = socket.gethostname(), link.advertise_host
    conn.send(("ready", info))
    try:
        worker.serve()
    finally:
        worker.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of a tensor/pipeline-parallel shoal engine")
    parser.add_argument("--driver", required=True, help="HOST:PORT the driver listens on")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument(
        "--advertise-host",
        default=None,
        help="the address other ranks reach this one at (default: the route to the driver)",
    )
    parser.add_argument("--spawned", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(message)s")
    key = os.environ.get(AUTHKEY_ENV)
    if not key:
        print(f"{AUTHKEY_ENV} must hold the driver's key", file=sys.stderr)
        return 2
    return run_worker(args.driver, args.rank, bytes.fromhex(key), args.spawned, args.advertise_host)


if __name__ == "__main__":
    sys.exit(main())
