"""Your own ZO loop (``workers.own_loop_zo``), without Ray: what a step accepts from your code (the loss, the
batch, the model's parameters), the model files the driver ships, the controller's answer to a code error,
and the refusals before anything starts. The runs themselves: ``tests/test_own_loop_zo_ray.py``."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest
import torch

from raycheck.orchestrator.api import job_config, run_own_loop
from raycheck.orchestrator.control import (Failed, FailRun, Limits, Observation, PersisterStatus, Running, WorkerGroupStatus, step,
                                           worker_group_status)
from raycheck.training.assets import module_files
from raycheck.training.model import materialise, parameter_layout, read_parameters, trainable_parameters
from raycheck.training.state import state_sha256
from raycheck.workers.own_loop_zo import OwnLoopError, batch_identity, first_difference, loss_value, own_env, parameters_changed
from raycheck.workers.zo_session import BatchMismatchError, CodeError


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(4, 1)


def test_a_batch_identity_follows_its_content_exactly():
    batch = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3), "y": [np.array([1, 2]), 3, "label", None]}
    same = {"y": [np.array([1, 2]), 3, "label", None], "x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    assert batch_identity(batch) == batch_identity(same) and 0 <= batch_identity(batch) < 2**63
    changed = [
        {**batch, "x": batch["x"].clone().index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(-0.0))},  # -0.0: other bits
        {**batch, "x": batch["x"].reshape(3, 2)},
        {**batch, "x": batch["x"].double()},
        {**batch, "y": [np.array([1, 2]), 3, "label"]},
        (batch["x"], batch["y"]),
    ]
    assert len({batch_identity(batch), *(batch_identity(c) for c in changed)}) == 1 + len(changed)
    assert batch_identity(torch.tensor(1.5)) != batch_identity(torch.tensor(2.5))  # 0-d tensors too
    with pytest.raises(OwnLoopError, match="batch_of returned a object inside its batch"):
        batch_identity([torch.zeros(1), object()])


def test_the_loss_must_be_one_finite_float_on_the_models_device():
    assert loss_value(torch.tensor(0.1, dtype=torch.float32), torch.device("cpu"), 3) == float(torch.tensor(0.1))
    bad = [
        (0.5, "returned a float at step 3: return a scalar tensor"),
        (torch.ones(2), r"shape \[2\] at step 3: return a scalar"),
        (torch.tensor(1), "int64 tensor at step 3"),
        (torch.tensor(float("nan")), "returned nan at step 3"),
        (torch.tensor(-math.inf), "returned -inf at step 3"),
        (torch.empty((), device="meta"), "on meta at step 3, the model is on cpu"),
    ]
    for loss, message in bad:
        with pytest.raises(OwnLoopError, match=message):
            loss_value(loss, torch.device("cpu"), 3)
    assert issubclass(OwnLoopError, CodeError) and issubclass(BatchMismatchError, CodeError)


def test_a_change_of_the_models_parameters_is_named():
    model = Net()
    held = trainable_parameters(model)
    layout = parameter_layout(held)
    assert parameters_changed(layout, held, trainable_parameters(model)) is None
    model.a.weight.data.add_(1.0)  # values change in place: allowed
    assert parameters_changed(layout, held, trainable_parameters(model)) is None
    model.a.weight.data = torch.zeros(4, 3)  # a new tensor: ZO would perturb the old one
    assert parameters_changed(layout, held, trainable_parameters(model)) == "parameter 'a.weight' was replaced by a new tensor"
    model.b = torch.nn.Linear(4, 2)
    assert parameters_changed(layout, held, trainable_parameters(model)) == \
        "the model's parameters changed (['b.weight', [1, 4], 'float32'] became ['b.weight', [2, 4], 'float32'])"
    reordered = OrderedDict(reversed(list(held.items())))
    assert parameters_changed(layout, held, reordered).startswith("the model's parameters changed (['a.weight'")


def test_the_shipped_model_files_give_back_the_drivers_weights_bitwise(tmp_path):
    torch.manual_seed(0)
    model = Net()
    files = module_files(model, "float32")
    assert files.source == "module:Net" and list(files.files) == ["model.safetensors"]
    again = read_parameters(materialise(files, tmp_path), parameter_layout(trainable_parameters(Net())), "float32")
    assert again is not None and state_sha256(again) == state_sha256(trainable_parameters(model))
    assert read_parameters(materialise(files, tmp_path), parameter_layout(trainable_parameters(torch.nn.Linear(3, 4))), "float32") is None
    folder, layout = materialise(files, tmp_path), parameter_layout(trainable_parameters(Net()))
    wider = Net()
    wider.b = torch.nn.Linear(4, 2)
    renamed = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    assert [first_difference(folder, parameter_layout(trainable_parameters(m)), "float32") for m in (wider, renamed)] == [
        "'b.weight' is [1, 4] in the driver's model, [2, 4] here", "the driver's model has no parameter '0.weight'"]
    assert first_difference(folder, parameter_layout(trainable_parameters(Net().to(torch.bfloat16))), "float32") == (
        "'a.weight' is bfloat16 here, the run's dtype is float32")
    assert first_difference(folder, layout[:2], "float32") == "this model has no parameter 'b.bias'"
    assert first_difference(folder, layout[2:] + layout[:2], "float32") == "the parameters come in another order"
    with pytest.raises(ValueError, match="parameter 'a.weight' is bfloat16, the run's dtype is float32: give dtype='bfloat16'"):
        module_files(Net().to(torch.bfloat16), "float32")


def test_a_code_error_fails_the_run_at_once_and_says_why():
    events = [{"kind": "failure", "target": "worker"},
              {"kind": "code_error", "rank": 0, "step": 4, "error": "BatchMismatchError: batch_of(3) is not deterministic"}]
    workers = worker_group_status(True, {}, events)
    assert workers == WorkerGroupStatus(running=True, failures=1, code_error="BatchMismatchError: batch_of(3) is not deterministic")
    state, actions = step(Running(), Observation(workers=workers, persister=PersisterStatus(restarts=0)), Limits(10, 10, 10))
    assert state == Failed("BatchMismatchError: batch_of(3) is not deterministic")
    assert actions == (FailRun("worker_code", "BatchMismatchError: batch_of(3) is not deterministic"),)


def test_run_own_loop_and_zeroth_order_refuse_what_they_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="run_own_loop trains zeroth-order .algo zo., not fo: for first order, call "
                                         "workers.own_loop.FirstOrderCheckpoints"):
        run_own_loop(job_config(tmp_path / "run", algo="fo", strategy="layerwise"), lambda config: None, Net())
    with pytest.raises(ValueError, match="run_own_loop does not run elastic worker counts"):
        run_own_loop(job_config(tmp_path / "run", workers=2, elastic={"min_workers": 1}), lambda config: None, Net())
    assert not (tmp_path / "run").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "steplog.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="holds a run already .its step log.: give run_own_loop a new out_dir"):
        run_own_loop(job_config(tmp_path / "old"), lambda config: None, Net())
    with pytest.raises(OwnLoopError, match="zeroth_order takes the config that orchestrator.api.run_own_loop's TorchTrainer passes"):
        own_env({"lr": 0.1}, Net())
