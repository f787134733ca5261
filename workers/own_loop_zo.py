"""MeZO from YOUR Ray Train loop: your ``torch.nn.Module``, your ``loss_fn(model, batch) -> scalar tensor``
and your deterministic ``batch_of(step)``. raycheck perturbs, computes the projected gradient, appends the
step record to the step log at the run's durability, updates, and restores the freshest state after a
failure; the shadow, log keeper, persister, failure injector and snapshot policy run around your loop as
they do for ``raycheck run`` (the same session, ``workers.zo_session.ZerothOrder``). The driver starts it
with ``orchestrator.api.run_own_loop``::

    def train_loop_per_worker(config):                  # config: what run_own_loop hands Ray Train
        model = MLP()                                   # the driver's initial weights are loaded into it
        zo = zeroth_order(config, model, loss_fn, batch_of)
        for step in zo.steps():                         # from the restored step to the run's last
            zo.step()                                   # loss_fn(model, batch_of(step)) twice, log, update
        zo.close()

    summary = run_own_loop(job_config("runs/mine", steps=100, zo={"lr": 1e-4}), train_loop_per_worker, MLP())

What exactness (a restored run bitwise equal to a failure-free one) requires of your code:

- ``loss_fn(model, batch)`` depends on the parameters and the batch alone: no dropout (the model is put in
  eval mode), no state outside the parameters that changes between steps (a BatchNorm's running
  statistics are buffers, not restored), deterministic kernels (``torch.use_deterministic_algorithms``
  is turned on for CUDA runs);
- ``batch_of(step)`` gives the same batch for the same step in every process (seed it from the step,
  never from a global generator); with several workers, each rank's part (``zo.rank`` of ``zo.world``);
- the model is built the same way in every process (the same parameter names, shapes, dtypes and
  order); its initial values are the driver's, loaded here.

Each worker's loss enters the step as one group of ``training.groups`` (rank r is group r): the step's
loss is the mean of the ranks' losses, summed exactly and in rank order, so the trajectory depends on
the worker count (as your own data split does) but not on timing.
"""

from __future__ import annotations

import hashlib
import math
import pathlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import psutil
import ray.train
import torch

from raycheck.actors.journal import RunChannel
from raycheck.job.config import OWN_MODEL_PREFIX, JobConfig
from raycheck.job.names import TRAINER_PREFIX
from raycheck.training.assets import ASSETS_KEY, shipped_model
from raycheck.training.groups import Terms
from raycheck.training.model import materialise, parameter_layout, read_parameters, trainable_parameters
from raycheck.workers.train_reports import ray_train_context
from raycheck.workers.worker_env import WorkerEnv
from raycheck.workers.zo_session import CodeError, StepBatch, ZerothOrder, worker_device

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> loss``: a scalar (0-dimensional) floating-point tensor on the model's device."""


class OwnLoopError(CodeError):
    """Your ``loss_fn``, ``batch_of`` or model broke a rule of ``zeroth_order`` (the message names which);
    nothing of the step was logged or applied, so the last logged state stays the run's, and the run fails
    at once (no restart would fix it)."""


def batch_identity(batch: Any) -> int:
    """A 63-bit identity of ``batch``'s content (recorded in the step log as the step's ``batch_id``):
    blake2b over every tensor's and array's dtype, shape and bytes, and every number's and string's
    ``repr``, walking lists, tuples and dicts (keys sorted).

    Raises:
        OwnLoopError: ``batch`` holds something else (e.g. an object without a stable content).
    """
    h = hashlib.blake2b(digest_size=8)

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().contiguous()
            h.update(f"T{x.dtype}{list(x.shape)}".encode())
            h.update(x.reshape(-1).view(torch.uint8).numpy().tobytes() if x.numel() else b"")
        elif isinstance(x, np.ndarray):
            h.update(f"A{x.dtype}{list(x.shape)}".encode() + np.ascontiguousarray(x).tobytes())
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}".encode())
            for item in x:
                walk(item)
        elif isinstance(x, Mapping):
            h.update(f"D{len(x)}".encode())
            for key in sorted(x, key=repr):
                h.update(repr(key).encode())
                walk(x[key])
        elif x is None or isinstance(x, (bool, int, float, str, bytes)):
            h.update(f"S{x!r}".encode())
        else:
            raise OwnLoopError(f"batch_of returned a {type(x).__name__} inside its batch: give tensors, arrays, numbers, strings, "
                               "or lists, tuples and dicts of them (raycheck records the batch's identity)")

    walk(batch)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def loss_value(loss: Any, device: torch.device, step: int) -> float:
    """``loss`` (what your ``loss_fn`` returned at ``step``) as a Python float, exactly.

    Raises:
        OwnLoopError: not a tensor, not a scalar, not floating point, on another device than the model's
            (``device``), or not finite (NaN or infinite).
    """
    if not isinstance(loss, torch.Tensor):
        raise OwnLoopError(f"loss_fn returned a {type(loss).__name__} at step {step}: return a scalar tensor (shape [])")
    if loss.ndim != 0:
        raise OwnLoopError(f"loss_fn returned a tensor of shape {list(loss.shape)} at step {step}: return a scalar (e.g. .mean())")
    if not loss.is_floating_point():
        raise OwnLoopError(f"loss_fn returned a {str(loss.dtype).removeprefix('torch.')} tensor at step {step}: return a floating-point loss")
    if loss.device.type != device.type:
        raise OwnLoopError(f"loss_fn returned a tensor on {loss.device} at step {step}, the model is on {device}: "
                           "compute the loss on the model's device (zo.device)")
    value = float(loss.detach().double())
    if not math.isfinite(value):
        raise OwnLoopError(f"loss_fn returned {value} at step {step} (under a +-eps perturbation of the weights): "
                           "nothing of this step was logged; lower zo.eps or zo.lr, or check the loss")
    return value


def parameters_changed(layout: list[list[Any]], held: Mapping[str, torch.Tensor], now: Mapping[str, torch.Tensor]) -> str | None:
    """What changed between the parameters a session holds (``held``, with ``layout``:
    ``training.model.parameter_layout``) and the model's parameters ``now`` (pure): None when nothing did;
    else one line naming the first change: another name, shape, dtype or order, or a parameter that is a
    new tensor (its storage moved)."""
    now_layout = parameter_layout(OrderedDict(now))
    if now_layout != layout:
        first = next((f"{a} became {b}" for a, b in zip(layout, now_layout) if a != b), f"{len(layout)} parameters became {len(now_layout)}")
        return f"the model's parameters changed ({first})"
    moved = next((n for n, p in held.items() if now[n].data_ptr() != p.data_ptr()), None)
    return f"parameter {moved!r} was replaced by a new tensor" if moved is not None else None


class OwnModelSession(ZerothOrder):
    """``ZerothOrder`` over your model, ``loss_fn`` and ``batch_of`` (made by ``zeroth_order``): each step's
    batch is one group per rank, scored by ``loss_fn`` with gradients off. Adds ``device`` (your batches'
    device), ``rank`` and ``world``.

    Raises (at each ``step``):
        OwnLoopError: see ``loss_value``, ``batch_identity``; or the model's parameters changed (another
            name, shape, dtype or order, or a parameter replaced by a new tensor) since the session began.
    """

    def __init__(self, env: WorkerEnv, loss_fn: LossFn, batch_of: Callable[[int], Any]) -> None:
        self.layout = parameter_layout(trainable_parameters(env.model))
        self.rank, self.world = env.rank, env.world
        self.loss_fn, self.user_batch_of = loss_fn, batch_of
        self.device = worker_device(env.cfg.device)
        super().__init__(env, self._step_batch)

    def _step_batch(self, step: int) -> StepBatch:
        changed = parameters_changed(self.layout, self.params, trainable_parameters(self.env.model))
        if changed is not None:
            raise OwnLoopError(f"{changed} since zeroth_order began: ZO trains a fixed set of tensors, changed in place")
        batch = self.user_batch_of(step)

        def score(_group: int) -> Terms:
            with torch.no_grad():
                return loss_value(self.loss_fn(self.env.model, batch), self.device, step), 1.0

        return StepBatch(groups=self.world, mine=(self.rank,), score=score, identity=batch_identity(batch))


def first_difference(folder: pathlib.Path, layout: list[list[Any]], dtype: str) -> str:
    """The first difference between a worker model's parameter ``layout`` (``training.model.parameter_layout``)
    and the driver's, shipped in ``folder`` (``training.assets.module_files``) in the run's ``dtype``: a
    parameter the driver's has not, another shape, another dtype than the run's, a parameter the worker's
    lacks, or (none of these) another order."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        shipped = {name: list(fh.get_slice(name).get_shape()) for name in fh.keys()}
    for name, shape, param_dtype in layout:
        if name not in shipped:
            return f"the driver's model has no parameter {name!r}"
        if shipped[name] != list(shape):
            return f"{name!r} is {shipped[name]} in the driver's model, {list(shape)} here"
        if param_dtype != dtype:
            return f"{name!r} is {param_dtype} here, the run's dtype is {dtype}"
    missing = sorted(set(shipped) - {name for name, _, _ in layout})
    return f"this model has no parameter {missing[0]!r}" if missing else "the parameters come in another order"


def own_env(config: dict, model: torch.nn.Module) -> WorkerEnv:
    """This Ray Train worker's ``WorkerEnv`` for your ``model``: ``config`` is what ``run_own_loop``'s
    TorchTrainer passes (``JobConfig.to_dict()`` plus the shipped model files); the driver's initial
    parameters are loaded into ``model`` in place, and the model is put in eval mode with gradients off.

    Raises:
        OwnLoopError: ``config`` is not ``run_own_loop``'s, or ``model``'s parameters are not the driver's
            (names, shapes, dtypes, order).
    """
    stamps = {"process_created_unix_s": psutil.Process().create_time(), "worker_start_unix_s": time.time()}
    config = dict(config)
    shipped = config.pop(ASSETS_KEY, None)
    if shipped is None or not str(config.get("model", "")).startswith(OWN_MODEL_PREFIX):
        exc = OwnLoopError("zeroth_order takes the config that orchestrator.api.run_own_loop's TorchTrainer passes to your "
                           "train_loop_per_worker: give it that argument, unchanged")
        ctx = ray_train_context()
        if ctx is not None and (name := ctx.get_experiment_name()).startswith(TRAINER_PREFIX):  # run_own_loop's trainer: its controller ends the run
            RunChannel.of_run(name.removeprefix(TRAINER_PREFIX), ray.get_runtime_context().namespace).event(
                "code_error", rank=ctx.get_world_rank(), step=None, error=f"{type(exc).__name__}: {exc}")
        raise exc
    cfg = JobConfig.from_dict(config)
    torch.set_num_threads(cfg.torch_threads)
    files = shipped_model(shipped, cfg.model)
    assert files is not None  # an own model is always shipped
    folder = materialise(files, cfg.cache_dir)
    run = RunChannel(cfg)
    model.to("cpu")  # restores and replays run on the CPU (the session moves the model to its device after them)
    layout = parameter_layout(trainable_parameters(model))

    def initial_weights() -> "OrderedDict[str, torch.Tensor]":
        params = read_parameters(folder, layout, cfg.dtype)
        if params is None:
            exc = OwnLoopError(f"this worker's model does not match the driver's {cfg.model.split(':', 1)[1]}: "
                               f"{first_difference(folder, layout, cfg.dtype)}; build the same model in the train loop as on the driver")
            run.event("code_error", rank=ray.train.get_context().get_world_rank(), step=None, error=f"{type(exc).__name__}: {exc}")
            raise exc
        return params

    model.eval()
    model.requires_grad_(False)
    with torch.no_grad():  # the initial weights are read from the node's cache, never held beside the model
        for p, value in zip(trainable_parameters(model).values(), initial_weights().values()):
            p.copy_(value)
    stamps["model_loaded_unix_s"] = time.time()
    ctx = ray.train.get_context()
    return WorkerEnv(cfg=cfg, rank=ctx.get_world_rank(), world=ctx.get_world_size(), run=run, stamps=stamps,
                     model=model, initial_weights=initial_weights)


def zeroth_order(config: dict, model: torch.nn.Module, loss_fn: LossFn, batch_of: Callable[[int], Any]) -> OwnModelSession:
    """The MeZO session of your train loop (see the module docstring): restores ``model`` when the run is
    resuming (the shadow's image, or a snapshot plus the step log tail), then ``steps()`` yields each
    step still to do and ``step()`` executes it; ``close()`` after the loop.

    Args:
        config: your ``train_loop_per_worker``'s argument (from ``orchestrator.api.run_own_loop``).
        model: your ``torch.nn.Module``, built as on the driver; trained in place, on the run's device.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, called twice per step with gradients off.
        batch_of: ``batch_of(step) -> batch`` for this rank: tensors, arrays, numbers, strings, or lists
            and dicts of them, on ``session.device``; deterministic in ``step``.

    Raises:
        OwnLoopError: ``config`` is not ``run_own_loop``'s, the model is not the driver's; at a step, see
            ``OwnModelSession``.
        workers.zo_session.BatchMismatchError: after a restart, ``batch_of`` of the newest logged step
            gives another batch than the one logged.
    """
    return OwnModelSession(own_env(config, model), loss_fn, batch_of)
