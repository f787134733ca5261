"""First-order training (AdamW) and the full training state as one ordered ``name -> tensor`` mapping.

Step t on rank r of W workers (batches are a pure function of (run seed, step), as on the ZO path)::

    indices = batch_indices(seed, t, B, n)[r::W]
    loss    = cross-entropy over the two label words at each prompt's last token (training.data)
    backward                      -> gradients (DDP over gloo when W > 1: averaged over the workers)
    clip to max_grad_norm         (optional, global L2 norm)
    AdamW step                    (torch.optim.AdamW, foreach=False, fused=False)

Determinism: CPU kernels with a fixed torch thread count, the same batch composition and padding,
the single-tensor (non-foreach, non-fused) AdamW path. The same state and batch give bitwise the same
next state, so a run restored from an exact checkpoint and recomputing its lost steps rejoins the
failure-free trajectory bit for bit (tests compare ``training.state.state_sha256``).

Training state (``FOTrainer.state_view``), in this order, float32 everywhere:

* every parameter, ``named_parameters`` order (tied tensors once): ``model.layers.3.mlp.up_proj.weight``
* ``optim.exp_avg.<param>``: Adam's first moment, the parameter's shape
* ``optim.exp_avg_sq.<param>``: Adam's second moment, the parameter's shape
* ``optim.step.<param>``: the parameter's Adam step count, shape ``(1,)`` (a view of torch's 0-d count)

``storage.units.unit_of`` puts each optimizer tensor in its parameter's unit, so a unit's shard holds
the weights with their matching moments and step count. Counts may differ between units: a composite
state (layers from different steps; LayerCheck, arXiv 2026; LLMTailor, PDSW'25) loads as it is, and
AdamW's bias correction then uses each parameter's own count.

Differential checkpoints (LowDiff, SC'25) and overlapped snapshots (GoCkpt) record what each AdamW
step consumed (the gradients after averaging and clipping) and replay it through the same optimizer
class: ``training.optim_steps``, the same for raycheck's AdamW as for a user's own optimizer.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from raycheck.training.data import PromptEncoder, Split
from raycheck.training.state import load_into
from raycheck.training.zo import decays

OPTIM_SLOTS = ("exp_avg", "exp_avg_sq", "step")
"""Optimizer-state slots in the training state, in this order: ``optim.<slot>.<parameter name>``."""


@dataclass(frozen=True, kw_only=True)
class FOHyper:
    """AdamW hyper-parameters (Loshchilov & Hutter, ICLR 2019; torch's defaults for the betas and eps).

    Attributes:
        lr: learning rate (> 0), constant.
        weight_decay: decoupled weight decay (>= 0), for matrices only (``training.zo.decays``).
        betas: exponential decay rates of the first and second moments, each in [0, 1).
        eps: added to the second moment's square root (> 0).
        max_grad_norm: clip the global L2 norm of the gradients to this (0: no clipping).
    """

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")


class _LabelScorer(torch.nn.Module):
    """Logits of the label words at each prompt's last token, [B, 2] float32, with gradients.

    Only the last hidden state of each prompt meets the LM head, and only the label words' rows of
    it: the same loss as ``training.data.label_logits`` (softmax over the two label words), without
    the [B, T, vocab] logits. Causal attention makes the right padding harmless.
    """

    lm: Any
    """A ``transformers`` causal LM: its decoder stack ``.model`` and its ``.lm_head`` (any architecture)."""
    label_ids: torch.Tensor
    """The label words' token ids, [2] int64 (a buffer)."""

    def __init__(self, lm: torch.nn.Module, label_ids: list[int]) -> None:
        super().__init__()
        self.lm = lm
        self.register_buffer("label_ids", torch.tensor(label_ids, dtype=torch.int64), persistent=False)

    def forward(self, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(input_ids=ids).last_hidden_state[torch.arange(ids.shape[0]), last]
        return cast(torch.Tensor, (hidden @ self.lm.lm_head.weight[self.label_ids].T).float())  # lm's submodules: untyped


class FOTrainer:
    """AdamW training of a ``transformers`` causal LM on prompt-based classification, on the CPU.

    Args:
        model: e.g. ``training.model.load_model("tiny")``; its ``requires_grad`` is switched on.
        hyper: AdamW settings.
        encoder: prompt encoder (label-word ids, padding).
        distributed: wrap the scorer in torch DDP (the default process group, gloo; Ray Train
            initialises it): gradients are averaged over the workers during ``backward``.
        sharded: shard the model with FSDP2 instead (``training.sharded``): parameters and moments
            are DTensors split over the workers (``distributed`` is then ignored).

    The optimizer state is created eagerly (zero moments, count 0: what AdamW creates lazily at its
    first step), so the training state has the same layout from step 0 on.
    """

    def __init__(self, model: torch.nn.Module, hyper: FOHyper, encoder: PromptEncoder, *, distributed: bool = False,
                 sharded: bool = False) -> None:
        self.model, self.hyper, self.encoder = model, hyper, encoder
        model.requires_grad_(True)
        scorer = _LabelScorer(model, encoder.label_ids)
        if sharded:  # before the parameters are taken: fully_shard replaces them with DTensors
            from raycheck.training.sharded import shard_scorer

            shard_scorer(scorer)
        self.named = OrderedDict(model.named_parameters())
        self.optimizer = adamw(self.named, hyper)
        for p in self.named.values():
            self.optimizer.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                       "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                       "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        ddp = distributed and not sharded
        self.scorer = torch.nn.parallel.DistributedDataParallel(scorer, broadcast_buffers=False) if ddp else scorer
        self._view = self._build_view()

    def _build_view(self) -> "OrderedDict[str, torch.Tensor]":
        view: OrderedDict[str, torch.Tensor] = OrderedDict((n, p.data) for n, p in self.named.items())
        for slot in OPTIM_SLOTS:
            for name, p in self.named.items():
                t = self.optimizer.state[p][slot]
                view[f"optim.{slot}.{name}"] = t.view(1) if slot == "step" else t
        return view

    def state_view(self) -> "OrderedDict[str, torch.Tensor]":
        """The live training state (see the module docstring): views, not copies; they change with
        every step. Copy before handing it to another thread (``training.state.copy_state``)."""
        return self._view

    def load_state(self, state: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """Copy a training state (e.g. a composite snapshot) into the model and the optimizer, in place.

        Raises:
            ValueError: names, order, shapes or dtypes differ from ``state_view`` (the message names
                the first mismatching tensors).
        """
        load_into(self._view, state)

    def compute_gradients(self, split: Split, indices: np.ndarray) -> float:
        """Forward and backward on the samples ``indices`` of ``split``; returns this rank's mean loss.

        Leaves each parameter's ``.grad`` (averaged over the workers with DDP); nothing is updated.
        """
        self.optimizer.zero_grad(set_to_none=True)
        ids, last = self.encoder.encode([split.texts[i] for i in indices])
        logits = self.scorer(ids, last)
        loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(split.labels[indices]))
        loss.backward()
        return float(loss.detach())

    def apply_gradients(self) -> None:
        """Clip the gradients left by ``compute_gradients`` (if configured), then one AdamW step."""
        if self.hyper.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(list(self.named.values()), self.hyper.max_grad_norm, foreach=False)
        self.optimizer.step()

    def train_step(self, split: Split, indices: np.ndarray) -> float:
        """``compute_gradients`` then ``apply_gradients``; returns this rank's mean loss."""
        loss = self.compute_gradients(split, indices)
        self.apply_gradients()
        return loss


def adamw(named: Mapping[str, torch.Tensor], hyper: FOHyper) -> torch.optim.AdamW:
    """torch's AdamW over ``named`` (parameter name -> float32 tensor) as ``FOTrainer`` runs it:
    ``hyper``'s settings, decoupled weight decay on matrices only (``training.zo.decays``), the
    single-tensor path (``foreach=False, fused=False``). Each parameter's update reads only its own
    weights, gradient and optimizer state, so an optimizer over a subset of the parameters updates
    them bitwise as the trainer's does."""
    groups = [
        {"params": [p for n, p in named.items() if decays(n, p)], "weight_decay": hyper.weight_decay},
        {"params": [p for n, p in named.items() if not decays(n, p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=hyper.lr, betas=hyper.betas, eps=hyper.eps,
                             foreach=False, fused=False)
