"""Replicas as Ray actors (``data_parallel_backend="ray"``, ``pip install nano-engine[ray]``):
one placement group holds a bundle per replica (a CPU and its tensor_parallel_size GPUs), so
the same code places replicas on this host or across the hosts of a Ray cluster. The cluster
is the one at ``data_parallel_address``, the one this process is already connected to, or a
local one started here (and stopped with the fleet).

Each replica is a threaded actor around a ``ReplicaCore``: ``submit``, ``abort`` and calls
run in order on its default thread; ``outputs`` long-polls on a thread of its own. A dead
actor fails the pending ``outputs`` call at once (Ray reports the actor's death), which is how
the front sees it.
"""

from __future__ import annotations

import contextlib
import logging
import time

from nano_engine.config import EngineConfig
from nano_engine.data_parallel import Backend
from nano_engine.data_parallel.replica import (
    STATS_PERIOD,
    Batch,
    ReplicaCore,
    ReplicaGone,
    ReplicaHandle,
    ReplicaInfo,
    RequestSpec,
)

log = logging.getLogger("nano_engine")
_PLACEMENT_TIMEOUT = 300.0  # seconds to wait for the cluster to hold every bundle
_POLL = "outputs"  # the concurrency group of the long poll
_UNAVAILABLE = 10.0  # seconds an unreachable actor has to come back


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "data_parallel_backend 'ray' needs Ray: pip install 'nano-engine[ray]' (or "
            "data_parallel_backend 'mp' for replicas on this host)"
        ) from None
    return ray


class RayReplica(ReplicaHandle):
    def __init__(self, index: int, actor, info: ReplicaInfo) -> None:
        self.index, self.actor, self.info = index, actor, info
        self._ray = _ray()
        self.closed = False

    def submit(self, specs: list[RequestSpec]) -> None:
        self.actor.submit.remote(specs)  # (a dead actor: its poll says so)

    def abort(self, request_id: str) -> None:
        self.actor.abort.remote(request_id)

    def poll(self) -> Batch:
        ray = self._ray
        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
        deadline = None
        while True:
            try:
                return ray.get(
                    self.actor.outputs.options(concurrency_group=_POLL).remote(STATS_PERIOD)
                )
            except unavailable as e:  # (unreachable for now: it may come back)
                deadline = deadline or time.monotonic() + _UNAVAILABLE
                if time.monotonic() < deadline and not self.closed:
                    time.sleep(0.2)
                    continue
                # (killed, so that what it held is not computed twice once sent elsewhere)
                self.stop()
                raise ReplicaGone(f"unreachable for {_UNAVAILABLE:.0f} s: {_why(e)}") from e
            except Exception as e:  # (once closed, Ray itself may be gone: any error)
                if isinstance(e, ray.exceptions.RayActorError) or self.closed:
                    raise ReplicaGone(_why(e)) from e
                raise

    def call(self, method: str, *args: object) -> object:
        ray = self._ray
        try:
            return ray.get(getattr(self.actor, method).remote(*args))
        except ray.exceptions.RayActorError as e:
            raise ReplicaGone(_why(e)) from e

    def stop(self) -> None:
        with contextlib.suppress(Exception):  # (dead already)
            self._ray.kill(self.actor)

    def close(self, timeout: float) -> None:
        ray = self._ray
        self.closed = True
        with contextlib.suppress(ray.exceptions.RayError):  # (dead already, or too slow)
            ray.get(self.actor.shutdown.remote(), timeout=timeout)
        self.stop()


def _why(error: Exception) -> str:
    """The first line of Ray's report of an actor's death."""
    text = str(error).strip().splitlines()
    return f"the Ray actor died: {text[0] if text else type(error).__name__}"


class RayBackend(Backend):
    def __init__(self) -> None:
        self.ray = None
        self.placement = None
        self.owned = False  # whether this process started the Ray cluster

    def start(self, config: EngineConfig) -> list[ReplicaHandle]:
        ray = self.ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._connect(config)
        try:
            n, tp = config.data_parallel_size, config.tensor_parallel_size
            device = config.device
            gpus_there = ray.cluster_resources().get("GPU", 0)
            if device == "auto":
                device = "cuda" if gpus_there > 0 else "cpu"
            gpus = tp if device == "cuda" else 0
            if gpus and gpus_there < n * gpus:
                raise ValueError(
                    f"data_parallel_size {n} x tensor_parallel_size {tp} needs {n * gpus} GPUs; "
                    f"the Ray cluster has {gpus_there:g}"
                )
            bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
            self.placement = placement_group([bundle] * n, strategy="PACK")
            ready, _ = ray.wait([self.placement.ready()], timeout=_PLACEMENT_TIMEOUT)
            if not ready:
                raise RuntimeError(
                    f"the Ray cluster did not make room for {n} replicas of {bundle} within "
                    f"{_PLACEMENT_TIMEOUT:.0f} s (resources: {ray.available_resources()})"
                )
            actor = ray.remote(
                num_cpus=1,
                num_gpus=gpus,
                max_concurrency=1,  # (the front's calls run in its order)
                concurrency_groups={_POLL: 1},
                max_restarts=0,
            )(ReplicaCore)
            replica_config = config.replace(data_parallel_size=1, device=device)
            actors = [
                actor.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement, placement_group_bundle_index=i
                    )
                ).remote(replica_config, i)
                for i in range(n)
            ]
            return self._started(actors)
        except BaseException:
            self.release()
            raise

    def _connect(self, config: EngineConfig) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        start = time.monotonic()
        if config.data_parallel_address is not None:
            ray.init(address=config.data_parallel_address, log_to_driver=True)
        else:
            ray.init(include_dashboard=False, log_to_driver=True)
            self.owned = True
        log.info(
            "Ray %s in %.1f s: %s",
            "started" if self.owned else "connected",
            time.monotonic() - start,
            ray.cluster_resources(),
        )

    def _started(self, actors: list) -> list[ReplicaHandle]:
        """Each actor's info once its engine has loaded; an actor that failed: an error
        naming it (the others are killed)."""
        ray = self.ray
        pending = {actor.info.remote(): i for i, actor in enumerate(actors)}
        infos: dict[int, ReplicaInfo] = {}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                index = pending.pop(done[0])
                try:
                    infos[index] = ray.get(done[0])
                except ray.exceptions.RayError as e:
                    raise RuntimeError(f"data-parallel replica {index} did not start: {e}") from e
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            raise
        return [RayReplica(i, actor, infos[i]) for i, actor in enumerate(actors)]

    def stop(self, replicas: list[ReplicaHandle]) -> None:
        ray = self.ray
        if ray is None:
            return
        for replica in replicas:
            replica.closed = True
        stops = [r.actor.shutdown.remote() for r in replicas]  # (all at once)
        with contextlib.suppress(ray.exceptions.RayError):
            ray.wait(stops, num_returns=len(stops), timeout=30.0)
        for replica in replicas:
            replica.close(timeout=1.0)

    def release(self) -> None:
        ray = self.ray
        if ray is None:
            return
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # (the cluster may be gone)
                remove_placement_group(self.placement)
            self.placement = None
        if self.owned:
            ray.shutdown()
            self.owned = False
