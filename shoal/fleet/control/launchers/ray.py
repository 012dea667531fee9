"""The Ray launcher (`shoal fleet up --launcher ray --address HOST:PORT`): each replica is a
`shoal serve` process owned by a Ray core actor, placed on the cluster's nodes through a placement
group of the CPUs it runs on. Ray only places and keeps the processes; shoal's own gateway, router
and autoscaler stay in charge (not Ray Serve, whose LLM layer runs other engines and adds
milliseconds to every request). Ray is an optional extra: `pip install 'shoal[ray]'`.

Every call from the controller returns at once (it runs on the gateway's event loop): a replica's
address is known once its actor has started it, and its exit once a poll of the actor says so.
Placing a replica, and releasing a dead one's actor and placement group, are synchronous calls to
Ray's GCS: they run on a thread of the launcher's own, so that a slow or unreachable GCS delays
only them, never the streams on the gateway's event loop."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

from shoal.fleet.control.cores import thread_env, threads_flag
from shoal.fleet.control.launchers.base import ReplicaSpec
from shoal.fleet.control.launchers.local import _die_with_parent, free_port
from shoal.protocol.supervision import PARENT_PID_ENV

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:  # the optional extra is not installed
    ray = None

log = logging.getLogger(__name__)

ACTOR_DIED = -9  # what a replica whose actor (or node) died reports as its exit


def _require_ray() -> None:
    if ray is None:
        raise RuntimeError("the Ray launcher needs Ray: pip install 'shoal[ray]'")


class ReplicaActor:
    """Runs on a Ray node: starts one replica process there and reports on it."""

    def __init__(self):
        self.popen: subprocess.Popen | None = None

    def start(self, args: list[str], env: dict[str, str], log_path: str) -> tuple[str, int, int, str]:
        host = ray.util.get_node_ip_address()
        port = free_port() if host in ("127.0.0.1", "localhost") else _free_port_on(host)
        cmd = [sys.executable, "-m", "shoal.cli", "serve", *args, "--host", host, "--port", str(port)]
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "a") as out:
            self.popen = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid()), **env},
                start_new_session=True,
                preexec_fn=_die_with_parent(),  # the replica goes with its actor
            )
        return host, port, self.popen.pid, ray.get_runtime_context().get_node_id()

    def poll(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def terminate(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()


def _free_port_on(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RayReplica:
    """The controller's handle on one replica placed by Ray (see launcher.LocalProcess)."""

    def __init__(self, launcher: RayLauncher, spec: ReplicaSpec):
        self.launcher = launcher
        self.address: tuple[str, int] | None = None
        self.pid: int | None = None
        self.started = None  # placed by Ray: not this host's process to find again
        self.node: str | None = None
        self._exit: int | None = None
        self._poll_ref = None
        self.actor = self.pg = self._started = None
        self._placing = launcher.in_background(self._place, spec)

    def _place(self, spec: ReplicaSpec) -> tuple:
        """On the launcher's thread: its placement group, its actor, and the actor's start call."""
        # As a local launcher shares a host's cores: the CPUs Ray reserves are the threads it runs.
        cpus = threads_flag(spec.args) or self.launcher.cpus
        bundle = {"CPU": cpus}
        if spec.memory_mb:  # placed only on a node with that much memory to spare
            bundle["memory"] = spec.memory_mb * 2**20
        pg = placement_group([bundle], strategy="STRICT_PACK")
        actor_cls = ray.remote(num_cpus=cpus, max_restarts=0)(ReplicaActor)
        strategy = PlacementGroupSchedulingStrategy(pg)
        actor = actor_cls.options(scheduling_strategy=strategy, name=None).remote()
        args = [*([spec.model] if spec.model else []), *spec.args]
        env = {**thread_env(max(1, int(cpus))), **spec.env}  # secrets travel here, not in argv
        return pg, actor, actor.start.remote(args, env, spec.log_path)

    def _check_started(self) -> None:
        if self.address is not None or self._exit is not None:
            return
        if self._started is None:
            if not self._placing.done():
                return
            try:
                self.pg, self.actor, self._started = self._placing.result()
            except Exception as exc:  # Ray refused the placement: the replica never ran
                log.warning("Ray could not place a replica: %s", exc)
                self._exit = ACTOR_DIED
                return
        ready, _ = ray.wait([self._started], timeout=0)
        if ready:
            try:
                host, port, self.pid, self.node = ray.get(self._started)
                self.address = (host, port)
            except ray.exceptions.RayError:
                self._finish(ACTOR_DIED)

    def poll(self) -> int | None:
        self._check_started()
        if self._exit is not None or self.address is None:
            return self._exit
        if self._poll_ref is None:
            self._poll_ref = self.actor.poll.remote()
        ready, _ = ray.wait([self._poll_ref], timeout=0)
        if ready:
            try:
                code = ray.get(self._poll_ref)
            except ray.exceptions.RayError:  # the actor, or its node, is gone: so is the replica
                code = ACTOR_DIED
            self._poll_ref = None
            if code is not None:
                self._finish(code)
        return self._exit

    def _finish(self, code: int) -> None:
        self._exit = code
        if self.actor is not None:
            self.launcher.in_background(_release, self.actor, self.pg)
        else:  # still being placed: released once it is
            self._placing.add_done_callback(self._release_when_placed)

    def _release_when_placed(self, placing: Future) -> None:
        if placing.exception() is None:
            pg, actor, _ = placing.result()
            self.launcher.in_background(_release, actor, pg)

    def terminate(self) -> None:
        if self._exit is None:
            if self.address is None:  # not started yet: nothing to stop gracefully
                return self._finish(ACTOR_DIED)
            self.actor.terminate.remote()
        return None

    def kill(self) -> None:
        if self._exit is None:
            if self.actor is not None:
                self.actor.kill.remote()
            self._finish(ACTOR_DIED)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("ray replica", timeout)
            time.sleep(0.05)
        return self._exit


class RayLauncher:
    """Replicas as processes of Ray actors on the nodes of the cluster at `address`."""

    name = "ray"
    host = "127.0.0.1"  # until a replica is placed (its node's address replaces it)

    def __init__(self, address: str, cpus_per_replica: float = 1.0):
        """`cpus_per_replica`: the fleet's per-replica cores (CoresConfig.per_replica), as Ray CPUs."""
        _require_ray()
        self.cpus = cpus_per_replica
        if address.split(":")[0] in ("127.0.0.1", "localhost"):
            # Ray would advertise this machine's other interface for "127.0.0.1", where a
            # loopback cluster does not listen; this keeps the driver on loopback.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        if not ray.is_initialized():
            ray.init(address=address, namespace="shoal", log_to_driver=False, configure_logging=False)
        self._control = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-ray-control")

    def port_in_use(self, port: int) -> bool:
        return False  # ports are chosen on the node, when the replica is placed

    def has_room(self) -> bool:
        return True  # Ray places a replica where its CPUs are free, or keeps it pending

    def port_for(self, base_port: int, index: int) -> int:
        return 0

    def spawn(self, spec: ReplicaSpec) -> RayReplica:
        return RayReplica(self, spec)

    def adopt(self, pid: int, started: int, host: str, address: tuple[str, int]) -> None:
        """Not found: a replica's actor belongs to the driver that made it (the gateway that led)."""
        return None

    def in_background(self, fn, *args) -> Future:
        """Runs a Ray control call off the caller's thread (the gateway's event loop), in order."""
        return self._control.submit(_timed, fn, *args)

    def shutdown(self) -> None:
        self._control.shutdown(wait=True, cancel_futures=False)
        ray.shutdown()


def _release(actor, pg) -> None:
    with contextlib.suppress(Exception):  # already gone with its node: nothing left to free
        ray.kill(actor, no_restart=True)
    with contextlib.suppress(Exception):
        remove_placement_group(pg)


def _timed(fn, *args):
    t0 = time.monotonic()
    try:
        return fn(*args)
    finally:
        if (spent := time.monotonic() - t0) > 1.0:
            log.warning("Ray control call %s took %.1f s", fn.__name__, spent)
