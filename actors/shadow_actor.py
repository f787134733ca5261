"""The shadow's Ray shell: ``ShadowActor`` builds the plain replay loop (``actors.shadow.ShadowLoop``)
from a ``actors.shadow.ShadowSpec`` and serves it over Ray; ``NamedPersister`` is the loop's image sink
in the actor, the persister actor looked up by name; ``find_shards`` looks up the shadow's shard actors
by the names the run's journal publishes (for workers and the failure injector).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch

from raycheck.actors.journal import RunChannel
from raycheck.actors.log_keeper import KeeperLogSource, RemoteKeeper
from raycheck.actors.shadow import ShadowLoop, ShadowReplayer, ShadowSpec
from raycheck.actors.shards import split_units
from raycheck.storage.manifest import layout_of
from raycheck.storage.snapshots import NoSnapshotError
from raycheck.training.assets import shipped_model
from raycheck.training.model import load_model, materialise, model_dir, read_parameters, trainable_parameters
from raycheck.training.node import this_node
from raycheck.training.state import load_into

log = logging.getLogger(__name__)


class NamedPersister:
    """The ``ImageSink`` of a shadow actor: the persister actor registered as ``name``, looked up at
    each call so that a restarted persister is found; the calls return without waiting for it.

    Raises:
        LookupError: (both methods) no persister is registered as ``name`` (it died and is being restarted).
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def _actor(self):
        try:
            return ray.get_actor(self.name)
        except ValueError as exc:
            raise LookupError(f"no snapshot persister registered as {self.name!r}") from exc

    def submit(self, step: int, state: dict[str, np.ndarray]) -> None:
        self._actor().submit.remote(step, state)

    def submit_part(self, step: int, shard: int, shards: int, part: dict[str, np.ndarray]) -> None:
        self._actor().submit_part.remote(step, shard, shards, part)


class ShadowActor:
    """Ray shell around a ``ShadowLoop`` (``loop``): loads the weights (its shard's) from the newest
    verified snapshot, else the initial weights, follows the log ``spec`` names, and starts the loop.

    Create with ``ray.remote(ShadowActor).options(num_cpus=0, max_concurrency=4, name=...)``.
    """

    def __init__(self, spec: ShadowSpec) -> None:
        torch.set_num_threads(spec.threads)
        self.spec = spec
        self.started_unix_s = time.time()
        self.actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        files = shipped_model(spec.shipped, spec.model)
        folder = materialise(files, spec.cache_dir) if files is not None else model_dir(spec.model, spec.cache_dir)
        params = read_parameters(folder, spec.layout, spec.dtype) if spec.layout else None
        if params is None:
            params = trainable_parameters(load_model(spec.model, spec.cache_dir, files, spec.dtype))
        layout = layout_of(params)
        self.range = split_units({n: p.numel() for n, p in params.items()}, spec.shards)[spec.shard]
        if spec.shards > 1:  # keep only this shard's tensors: the rest of the model is freed
            params = OrderedDict((n, params[n]) for n in self.range.names(list(params)))
        try:
            info, state, _ = spec.store.load_latest(layout=layout, units=list(self.range.units) if spec.shards > 1 else None)
            load_into(params, state)
            self.base: dict[str, Any] = {"source": "snapshot", "step": info.step}
        except (NoSnapshotError, OSError) as exc:  # OSError: storage unreachable; replay the whole log
            log.warning("shadow starts from the initial weights: %s", exc)
            self.base = {"source": "initial", "step": 0}
        source = KeeperLogSource(RemoteKeeper(spec.log_keeper_name)) if spec.log_keeper_name else spec.log_path
        replayer = ShadowReplayer(params, source, self.base["step"], spec.hash_every, self.range if spec.shards > 1 else None)
        self.loop = ShadowLoop(replayer, NamedPersister(spec.persister_name) if spec.persister_name else None,
                               spec.snapshot_every_steps, shard=spec.shard, shards=spec.shards, poll_interval_s=spec.poll_interval_s)
        self.loop.start()

    def status(self) -> dict:
        """``ShadowLoop.status``, the ``base`` of this incarnation (``{"source": "snapshot" or
        "initial", "step": int}``), what it holds (``units``, ``elements``), its Ray ``actor_id``,
        ``started_unix_s``, ``cpu_capability`` and where it runs (``node_id``, ``node_ip``)."""
        return {
            **self.loop.status(),
            "units": self.range.describe(),
            "elements": self.range.elements,
            "actor_id": self.actor_id,
            "base": self.base,
            "started_unix_s": self.started_unix_s,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # differs under ATEN_CPU_CAPABILITY
            **this_node(),
        }

    def stop(self) -> None:
        """``ShadowLoop.stop``."""
        self.loop.stop()

    def set_interval(self, every_steps: int) -> None:
        """``ShadowLoop.set_interval``."""
        self.loop.set_interval(every_steps)

    def snapshot_now(self) -> int:
        """``ShadowLoop.snapshot_now``."""
        return self.loop.snapshot_now()

    def snapshot_at(self, step: int) -> bool:
        """``ShadowLoop.snapshot_at``."""
        return self.loop.snapshot_at(step)

    def image(self, min_step: int, timeout_s: float) -> dict:
        """``ShadowLoop.image`` (through Ray, put in the object store: the caller reads it zero-copy)."""
        return self.loop.image(min_step, timeout_s)

    def state_sha256(self, step: int, timeout_s: float) -> str:
        """``ShadowLoop.state_sha256``."""
        return self.loop.state_sha256(step, timeout_s)

    def hashes(self) -> dict[int, str]:
        """``ShadowLoop.hashes``."""
        return self.loop.hashes()


def find_shards(run: RunChannel, namespace: str, timeout_s: float, alive: Callable[[object], bool] | None = None) -> list | None:
    """Every shard's current handle (named by the shadow pointer in the journal ``run``), in shard order,
    or None unless all of them answer within ``timeout_s``. ``alive(handle)`` decides whether a found
    handle counts (default: it is registered)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pointer = run.shadow_pointer() or {}
        handles = []
        for entry in pointer.get("shards") or ([pointer] if "name" in pointer else []):
            try:
                handle = ray.get_actor(entry["name"], namespace=namespace)
            except ValueError:
                break
            if alive is not None and not alive(handle):
                break
            handles.append(handle)
        else:
            if handles:
                return handles
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)
