"""Job configuration: one frozen dataclass, validated up front, serialisable to the workers."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Literal

from raycheck.job.options import (absolute, duration_text, endpoint_of, endpoint_options, env_pairs, opt, parse_duration, parse_env,
                                  shown_newlines, storage_uri, typed_newlines)
from raycheck.policies.layerwise import LayerwiseConfig
from raycheck.policies.strategies import FULL_STATE, STEP_LOG, RunStrategy
from raycheck.storage.backend import local_path, node_local, split_uri

FailureTarget = Literal["worker", "shadow", "both", "corrupt", "persister", "storage", "node", "preempt", "preempt-shadow"]
FailureHow = Literal["exit", "raise", "sigkill", "torn"]
TARGETS = ("worker", "shadow", "both", "corrupt", "persister", "storage", "node", "preempt", "preempt-shadow")
ALGOS = ("zo", "fo")
STRATEGIES = {
    "zo": (RunStrategy.SHADOW, RunStrategy.FULL_SYNC, RunStrategy.FULL_ASYNC, RunStrategy.LOG_ONLY),
    "fo": (RunStrategy.FULL_SYNC, RunStrategy.FULL_ASYNC, RunStrategy.LAYERWISE, RunStrategy.DIFFERENTIAL, RunStrategy.OVERLAPPED),
}
"""Checkpointing strategies by algorithm (each one: ``policies.strategies.RunStrategy``)."""
DEFAULT_STRATEGY = {"zo": RunStrategy.SHADOW, "fo": RunStrategy.LAYERWISE}
FO_PARALLELISMS = ("ddp", "fsdp2")
"""How first-order workers share the state: ``ddp`` (each holds all of it) or ``fsdp2`` (sharded, ``training.sharded``)."""
HOWS = ("exit", "raise", "sigkill", "torn")
WORKER_TARGETS = ("worker", "both")
PREEMPT_TARGETS = ("preempt", "preempt-shadow")
"""Failures that drain a node with a deadline (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``) and take it
down at the deadline: rank 0's node, or the node of the shadow's shard 0."""
DEFAULT_PREEMPT_GRACE_S = 30.0
"""The notice a ``preempt`` failure gives by default, in seconds (about GCP's; AWS gives 120 s)."""
"""The failure targets that kill a train worker, the only ones whose ``FailureSpec.how`` says how it dies."""
DURABILITIES = ("process", "node", "cluster")
STORAGE_CONSISTENCIES = ("fenced", "unfenced")
"""Fault domains a step record survives before its update (``workers.rank0_log``)."""
DEVICES = ("cpu", "cuda")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The parameter dtypes a ZO run may hold and perturb its weights in (``JobConfig.dtype``), by the name
the step log header records (key ``dtype``); ``training.zo.DTYPES`` maps each to its torch dtype."""
TASKS = ("classification", "causal-lm")
"""What a run trains (``JobConfig.task``; ``training.data``)."""
PROMPT = "Review: {text}\nSentiment:"
LABEL_WORDS = (" negative", " positive")  # label 0 = rotten, 1 = fresh
"""Classification's default prompt and label words (the Rotten Tomatoes snippets, ``training.data``)."""
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""An environment variable name (``shadow_env`` keys)."""
MODEL_NAMES = ("smollm2-135m", "tiny")
"""The built-in models, by name (``training.model`` builds each into a node's cache from installed wheels)."""
OWN_MODEL_PREFIX = "module:"
"""``JobConfig.model`` of a run of your own model and loop: this prefix and the model's class name (``JobConfig.own_model``)."""
SEED_LIMIT = 2**64
"""Run seeds are packed as unsigned 64-bit integers (``training.zo.derive_seed``, ``numpy`` generators)."""


def _require_positive(name: str, value: float) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number > 0."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class FailureSpec:
    """A failure injected at ``step`` (during that step, after its first forward pass).

    Attributes:
        step: 0-based step during which the failure happens.
        target: ``worker`` (a train worker dies), ``shadow`` (the shadow replayer is killed), or
            ``both`` (the shadow is killed, then a worker dies: recovery must use storage + log tail),
            or ``corrupt`` (one byte of the newest committed snapshot is flipped; nothing dies), or
            ``persister`` (the snapshot persister actor is killed; the controller restarts it), or
            ``storage`` (the snapshot storage server is down for ``how`` seconds; needs a server the
            controller can stop, see ``Controller(storage_outage=...)``), or ``node`` (rank 0 takes down
            its whole Ray node, raylet and every process, ``workers.preempt.take_down_node``; needs
            another node for the workers, ``orchestrator.prepare.check_node_failures``), or ``preempt`` /
            ``preempt-shadow`` (a preemption notice: rank 0's node, or shadow shard 0's, is drained with a
            deadline ``how`` seconds away, default ``DEFAULT_PREEMPT_GRACE_S``, and taken down at the deadline:
            ``workers.preempt``). A ``shadow`` failure kills
            every shard of a sharded shadow, or only shard ``how`` when it is a number (``12:shadow:1``).
        how: for ``worker`` and ``both``, how the worker dies: ``exit`` (``os._exit(1)``, the default),
            ``raise`` (``workers.faults.InjectedWorkerFailure``: the process survives; one worker restarts
            in process, ``training.in_process``), ``sigkill``, or ``torn`` (rank 0 dies half-way through
            writing a step log record: a torn tail); for ``storage``, the outage in seconds (e.g. ``20``);
            for ``preempt`` and ``preempt-shadow``, the notice (grace) in whole seconds, >= 0 (e.g. ``10``);
            for ``shadow``, the shard number, or None (every shard); None for the others, which have no
            how. ``exit`` given for a target other than a worker one (the default that ``config.json``
            files of earlier versions record for every target) reads as None, so both forms load alike.

    Raises:
        ValueError: a negative step, an unknown target, or a ``how`` the target does not take.
    """

    step: int
    target: FailureTarget | str = "worker"
    how: FailureHow | str | None = None

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"failure step must be >= 0, got {self.step}")
        if self.target not in TARGETS:
            raise ValueError(f"failure target {self.target!r}: choose one of {', '.join(TARGETS)}")
        if self.target in WORKER_TARGETS:
            object.__setattr__(self, "how", "exit" if self.how is None else self.how)
        elif self.how == "exit" and self.target != "storage":
            object.__setattr__(self, "how", None)  # an earlier version's saved default: means nothing here
        how = self.how
        if self.target == "storage":
            if how is None or not how.replace(".", "", 1).isdigit() or not float(how) > 0:
                got = "none" if how in (None, "exit") else repr(how)  # "exit": an earlier version's default
                raise ValueError(f"a storage failure needs its outage in seconds, e.g. {self.step}:storage:20 (got {got})")
        elif self.target in PREEMPT_TARGETS:
            if how is not None and not how.isdigit():
                raise ValueError(f"a {self.target} failure takes its notice in whole seconds, e.g. {self.step}:{self.target}:10 "
                                 f"(got {how!r})")
        elif self.target == "shadow":
            if how is not None and not how.isdigit():
                raise ValueError(f"a shadow failure selects a shard by its number, e.g. {self.step}:shadow:1 (got {how!r})")
        elif self.target not in WORKER_TARGETS:
            if how is not None:
                raise ValueError(f"a {self.target} failure takes no how (got {how!r})")
        elif how not in HOWS:
            raise ValueError(f"failure how {how!r}: choose one of {', '.join(HOWS)}")

    @property
    def shard(self) -> int | None:
        """The shadow shard a ``shadow`` failure kills (None: every shard, or not a shadow failure)."""
        return int(self.how) if self.target == "shadow" and self.how is not None else None

    @property
    def grace_s(self) -> float | None:
        """The notice of a ``preempt`` / ``preempt-shadow`` failure, in seconds (None for the other targets)."""
        if self.target not in PREEMPT_TARGETS:
            return None
        return DEFAULT_PREEMPT_GRACE_S if self.how is None else float(self.how)

    @property
    def outage_s(self) -> float | None:
        """The seconds a ``storage`` failure keeps the storage server down (None for the other targets)."""
        return float(self.how) if self.target == "storage" and self.how is not None else None

    @classmethod
    def parse(cls, text: str) -> "FailureSpec":
        """Parse ``STEP[:TARGET[:HOW]]``, e.g. ``20``, ``35:shadow``, ``12:worker:sigkill``."""
        parts = text.split(":")
        if not 1 <= len(parts) <= 3 or not parts[0].isdigit():
            raise ValueError(f"bad failure {text!r}: expected STEP[:TARGET[:HOW]], e.g. 20:worker:exit")
        if len(parts) == 3 and parts[1] not in ("worker", "both", "storage", *PREEMPT_TARGETS) and not (parts[1] == "shadow" and parts[2].isdigit()):
            raise ValueError(f"bad failure {text!r}: HOW applies to worker, both, storage and preempt failures only "
                             f"(a shadow failure takes a shard number instead, e.g. {parts[0]}:shadow:1)")
        return cls(step=int(parts[0]), **dict(zip(("target", "how"), parts[1:])))


def parse_failures(texts: list[str]) -> tuple[FailureSpec, ...]:
    """``--fail`` values (``STEP[:TARGET[:HOW]]``) as ``FaultConfig.failures``."""
    return tuple(FailureSpec.parse(text) for text in texts)


def failure_texts(failures: tuple[FailureSpec, ...]) -> list[str]:
    """``parse_failures``' inverse: each failure as ``--fail`` takes it."""
    return [":".join(str(part) for part in (f.step, f.target, f.how) if part is not None) for f in failures]


def model_arg(model: str) -> str:
    """``--model`` as the configuration keeps it: a built-in name or model id as given, a folder absolute."""
    return model if model in MODEL_NAMES or not pathlib.Path(model).is_dir() else str(pathlib.Path(model).resolve())


def _require_at_least(owner: str, component: object, names: tuple[str, ...], low: int) -> None:
    """Raise ``ValueError`` naming ``owner.name`` for the first of ``names`` on ``component`` below ``low``."""
    for name in names:
        if getattr(component, name) < low:
            raise ValueError(f"{owner}.{name} must be >= {low}, got {getattr(component, name)}")


@dataclass(frozen=True, kw_only=True)
class ZOConfig:
    """MeZO (algo ``zo``): the zeroth-order optimiser and how a step's batch is split."""

    lr: float = field(default=1e-6, metadata=opt('--lr', 'Zeroth-order (MeZO)', metavar='NUMBER',
            help='Learning rate.'))
    """MeZO learning rate, constant."""
    eps: float = field(default=1e-3, metadata=opt('--eps', 'Zeroth-order (MeZO)', metavar='NUMBER',
            help='MeZO perturbation scale.'))
    """MeZO perturbation scale."""
    micro_batch_size: int = field(default=0, metadata=opt('--micro-batch-size', 'Zeroth-order (MeZO)', min=0, unit="examples",
            help='zo: examples per example group; each group is one forward pass whichever worker runs it, '
            'so the losses do not depend on --workers (docs/elastic.md). A divisor of --batch-size '
            'giving at least --workers groups; 0: batch-size / workers.'))
    """Examples per example group (``training.groups``): the step's batch is scored in groups of this many
    examples, each group one forward pass whichever worker computes it, so the losses do not depend
    on the worker count (docs/elastic.md). ``batch_size`` must be a multiple, with at least ``workers`` groups.
    0: ``batch_size // workers`` (one group per worker; one worker scores the whole batch at once)."""

    def __post_init__(self) -> None:
        _require_positive("zo.lr", self.lr)
        _require_positive("zo.eps", self.eps)
        if self.micro_batch_size < 0:
            raise ValueError(f"zo.micro_batch_size must be >= 0 (0: batch_size / workers), got {self.micro_batch_size}")


@dataclass(frozen=True, kw_only=True)
class FOConfig:
    """First-order training (algo ``fo``): AdamW and how the workers share the state."""

    lr: float = field(default=1e-5, metadata=opt('--fo-lr', 'First-order',
            help='fo: AdamW learning rate (constant).'))
    """AdamW learning rate, constant."""
    max_grad_norm: float = field(default=1.0, metadata=opt('--fo-max-grad-norm', 'First-order', min=0,
            help="fo: clip the gradients' global L2 norm to this (0: off)."))
    """Clip the global L2 norm of the gradients to this before each AdamW step (0: no clipping)."""
    parallelism: str = field(default="ddp", metadata=opt('--fo-parallelism', 'First-order', metavar='ddp|fsdp2',
            help='fo: ddp (every worker holds the whole state) or fsdp2 (state sharded over the workers with'
            ' FSDP2; checkpoints per rank with torch DCP, so --resume --workers N may change the worker'
            ' count).'))
    """``ddp`` (every worker holds the whole state; DDP averages the gradients) or ``fsdp2`` (FSDP2
    ``fully_shard``: parameters and moments split over the workers, checkpoints written per rank with
    torch DCP and resharded on load, so a ``--resume`` may change ``workers``; strategies full-sync and
    full-async only; ``training.sharded``)."""

    def __post_init__(self) -> None:
        _require_positive("fo.lr", self.lr)
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise ValueError(f"fo.max_grad_norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        if self.parallelism not in FO_PARALLELISMS:
            raise ValueError(f"fo.parallelism {self.parallelism!r}: choose one of {', '.join(FO_PARALLELISMS)}")


@dataclass(frozen=True, kw_only=True)
class DifferentialConfig:
    """Strategy ``differential``: full checkpoints and per-step gradient records between them."""

    full_every_steps: int = field(default=50, metadata=opt('--diff-full-every', 'First-order', min=1, unit="steps",
            help='fo differential: steps between full checkpoints.'))
    """Steps between full checkpoints (LowDiff's F)."""
    batch_steps: int = field(default=5, metadata=opt('--diff-batch-steps', 'First-order', min=1,
            help='fo differential: per-step gradient records per object.'))
    """Per-step gradient records written together as one object."""
    topk: float = field(default=0.0, metadata=opt('--diff-topk', 'First-order', min=0, max=1,
            help='fo differential: 0 exact records; else the fraction of elements kept (top-k, approximate).'))
    """0 for exact records (bitwise recovery); in (0, 1] the fraction of each gradient's elements kept
    (top-k by magnitude; approximate recovery)."""

    def __post_init__(self) -> None:
        _require_at_least("differential", self, ("full_every_steps", "batch_steps"), 1)
        if not 0 <= self.topk <= 1:
            raise ValueError(f"differential.topk must be in [0, 1] (0: exact records), got {self.topk}")


@dataclass(frozen=True, kw_only=True)
class OverlappedConfig:
    """Strategy ``overlapped`` (``training.overlapped``)."""

    chunks: int = field(default=4, metadata=opt('--overlap-chunks', 'First-order', min=1,
            help='fo overlapped: stage each snapshot in this many chunks, one per step (GoCkpt); the '
            "snapshot is of the last one's step."))
    """m, the chunks (balanced by bytes) a snapshot is staged in, one per step over m consecutive steps;
    1 is a one-shot staged copy."""

    def __post_init__(self) -> None:
        _require_at_least("overlapped", self, ("chunks",), 1)


PERSISTER_PRIORITIES = ("normal", "idle")


@dataclass(frozen=True, kw_only=True)
class SnapshotConfig:
    """When snapshots (checkpoints) are taken and how many are kept."""

    every_steps: int = field(default=10, metadata=opt('--snapshot-every', 'Snapshots, step log and storage', min=0, unit="steps",
            help='Fixed snapshot/checkpoint interval in steps (0: log only).'))
    """Fixed snapshot interval in steps (0: log-only); ignored when ``policy`` is adaptive."""
    policy: str = field(default="fixed", metadata=opt('--snapshot-policy', 'Snapshots, step log and storage', metavar='fixed|adaptive',
            help='fixed (--snapshot-every) or adaptive (cost model, re-planned from measured costs; zo with the shadow strategy).'))
    """``fixed`` (every ``every_steps`` steps) or ``adaptive`` (the cost model's optimum for the
    costs measured while the job runs, re-planned as they change: ``policies.replan``)."""
    mtbf_s: float = field(default=3600.0, metadata=opt('--mtbf', 'Snapshots, step log and storage', metavar='DURATION', unit="s", type=str, parse=parse_duration, show=duration_text,
            help='Assumed job MTBF for the adaptive policy, e.g. 30min, 3h.'))
    """Assumed mean time between failures of the job, seconds, for the adaptive policy (refined by
    the failures it sees)."""
    keep: int = field(default=3, metadata=opt('--keep-snapshots', 'Snapshots, step log and storage', min=1,
            help='Complete snapshots to keep.'))
    """Complete snapshots kept in the storage."""
    persister_priority: str = field(default="normal", metadata=opt('--persister-priority', 'Snapshots, step log and storage', metavar='normal|idle',
            help="CPU and I/O priority of the snapshot persister's process: normal, or idle (SCHED_IDLE, "
            'nice 19, idle I/O: it writes only in CPU time the training leaves).'))
    """CPU and I/O priority of the snapshot persister's process: ``normal``, or ``idle`` (every thread at
    ``SCHED_IDLE``, nice 19 and idle I/O class: ``storage.priority.lower_to_idle``), so that its
    serialising, hashing and writing take only CPU time the training processes leave; its snapshots
    then become durable later, or not at all while the CPUs are saturated."""
    persister_direct_io: bool = field(default=True, metadata=opt('--persister-direct-io', 'Snapshots, step log and storage',
            help='The persister writes local snapshots with direct I/O (O_DIRECT, no page cache: the disk '
            'work runs at its own priority); --no-persister-direct-io: buffered.'))
    """The persister's local snapshot writes bypass the page cache (``Storage(write_direct=True)``:
    ``O_DIRECT``, 256 KiB per ``fdatasync``), so its own thread, at ``persister_priority``, moves the
    bytes to the disk instead of the kernel's flusher threads at normal priority (docs/performance.md#snapshot-writes-and-the-logs-fsync);
    False: buffered writes. Other snapshot writers (training ranks, tools) always write buffered."""

    def __post_init__(self) -> None:
        if self.persister_priority not in PERSISTER_PRIORITIES:
            raise ValueError(f"snapshot.persister_priority {self.persister_priority!r}: choose normal or idle")
        if self.every_steps < 0:
            raise ValueError(f"snapshot.every_steps must be >= 0 (0: off), got {self.every_steps}")
        if self.policy not in ("fixed", "adaptive"):
            raise ValueError(f"snapshot.policy {self.policy!r}: choose fixed or adaptive")
        if not self.mtbf_s > 0:
            raise ValueError(f"snapshot.mtbf_s must be > 0, got {self.mtbf_s}")
        _require_at_least("snapshot", self, ("keep",), 1)


@dataclass(frozen=True, kw_only=True)
class StorageConfig:
    """Where snapshots (and, remote, the step log's segments and the stored config) go."""

    uri: str = field(default="", metadata=opt('--storage', 'Snapshots, step log and storage', metavar='URI', parse=storage_uri,
            help='Snapshot storage: a path, file://PATH or s3://BUCKET/PREFIX. Default: <out>/snapshots.'))
    """Snapshot storage URI (a path, ``file://``, ``s3://bucket/prefix``); empty: ``<out_dir>/snapshots``."""
    options: dict[str, Any] = field(default_factory=dict, metadata=opt('--s3-endpoint', 'Snapshots, step log and storage', metavar='URL', type=str, parse=endpoint_options, show=endpoint_of,
            help='S3 endpoint URL (default: $AWS_ENDPOINT_URL; keys from '
            '$AWS_ACCESS_KEY_ID/$AWS_SECRET_ACCESS_KEY).'))
    """Backend options, e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}``; credentials come from the
    standard AWS environment variables."""
    consistency: str = field(default="fenced", metadata=opt('--storage-consistency', 'Snapshots, step log and storage', metavar='fenced|unfenced',
            help='fenced: a remote --storage must honour conditional writes (probed at the start) or the run'
            ' is refused; unfenced: run on one that ignores them, without fencing of stale writers '
            '(recorded in summary.json).'))
    """``fenced``: a remote store must honour conditional writes (probed at the start,
    ``Storage.check_conditional_writes``), or the run is refused; ``unfenced``: run on one that does not,
    accepting that a stale writer is no longer fenced off (docs/storage.md)."""
    ray_train: str = field(default="", metadata=opt('--ray-train-storage', 'Snapshots, step log and storage', metavar='URI', parse=storage_uri,
            help="Ray Train's storage_path, where it keeps the pointers to the snapshots it lists (Result.checkpoint): "
            'a path or s3://BUCKET/PREFIX (with --s3-endpoint). Default: <out>/ray_train, the driver\'s disk, which '
            'workers on other nodes cannot reach: on a cluster, give a bucket. Ray Train itself writes there: an outage '
            'of it can fail the run, one of --storage does not.'))
    """Ray Train's ``RunConfig.storage_path`` (a path or ``s3://bucket/prefix``, read with ``options``);
    empty: ``<out_dir>/ray_train``. Ray Train lists the run's snapshots there (``workers.train_reports``):
    on a cluster of several nodes it must be a URI every node reaches, or the reports carry no checkpoint.
    Ray Train's controller and workers write there themselves, so an outage of it stops Ray Train (unlike
    one of ``uri``, which the run outlives): the reason the default is the driver's disk."""

    def __post_init__(self) -> None:
        if self.consistency not in STORAGE_CONSISTENCIES:
            raise ValueError(f"storage consistency {self.consistency!r}: choose one of {', '.join(STORAGE_CONSISTENCIES)}")
        for uri in (self.uri, self.ray_train):
            storage_uri(uri)  # as the command line reads it: no URI naming nothing, no lost slash (ValueError)
        if split_uri(self.ray_train)[0] not in ("file", "s3"):
            raise ValueError(f"Ray Train's storage {self.ray_train!r}: give a path or s3://BUCKET/PREFIX")

    @property
    def remote(self) -> bool:
        """True when snapshots leave this machine (the step log is then mirrored there too)."""
        return local_path(self.uri) is None


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """Injected failures, and the budgets and timeouts of recovering from any failure."""

    failures: tuple[FailureSpec, ...] = field(default=(), metadata=opt('--fail', 'Run', metavar='STEP[:TARGET[:HOW]]', type=list[str], parse=parse_failures, show=failure_texts,
            help='Inject a failure during step STEP (0-based, 0..steps-1). TARGET (default worker): worker, shadow, '
            'both (the shadow, then a worker), corrupt (flip a byte of the newest snapshot), persister, node, storage. '
            'HOW, for worker and both: exit (default), raise (an exception, the process survives, see '
            '--max-in-process-restarts), sigkill, torn; for shadow: the shard number; for storage: the outage in '
            "seconds (STEP:storage:SECONDS; needs a server raycheck owns: tests, experiments/s3_server.py). node: rank 0 "
            "takes down its whole Ray node (raylet and every process; needs another node for the workers, the driver's "
            'node hosting none, and an s3:// --storage). preempt[:GRACE] and preempt-shadow[:GRACE]: a preemption '
            "notice: rank 0's node (or the shadow's) is drained with a deadline GRACE seconds away (default 30; ray "
            "drain-node --reason DRAIN_NODE_REASON_PREEMPTION), what it holds is saved, and it is taken down at the "
            'deadline (needs another node for what it held). Repeatable.'))
    """Failures to inject (``FailureSpec``)."""
    settle_failures: bool = field(default=False, metadata=opt('--settle-failures', 'Failures and restarts',
            help='Before each injected failure, wait until the shadow has caught up and snapshots are '
            'committed, so the recovery source depends on the failure steps alone (reproducible '
            'experiments; real failures do not wait).'))
    """Before each injected failure, wait until the shadow has replayed every durable step and every
    snapshot and background checkpoint handed on is committed (``workers.faults``), so that which
    source serves a recovery depends on the failure steps alone, not on machine speed. For tests and
    reproducible failure experiments; a real failure does not wait, so the default is off."""
    max_shadow_restarts: int = field(default=10, metadata=opt('--max-shadow-restarts', 'Failures and restarts',
            help='Restarts of a failed shadow before the run fails (-1: unlimited; per shard).'))
    """Restarts of a failed shadow (its actor died or its replay thread stopped) before the run fails
    (-1: unlimited); with several shards, each shard has this budget of its own."""
    max_persister_restarts: int = field(default=10, metadata=opt('--max-persister-restarts', 'Failures and restarts',
            help='Restarts of a dead snapshot persister before the run fails (-1: unlimited).'))
    """Restarts of a dead snapshot persister before the run fails (-1: unlimited; ``orchestrator.controller``)."""
    max_worker_failures: int = field(default=10, metadata=opt('--max-worker-failures', 'Failures and restarts',
            help='Worker-group restarts after a train worker failed before the run fails, and apart from them as many '
            'warm-standby promotions (-1: unlimited; injected failures count).'))
    """Worker-group restarts after a train worker failed (Ray Train's ``FailureConfig.max_failures``)
    before the run fails (-1: unlimited), and, counted apart, as many warm-standby promotions
    (``workers.standby``). Injected ``worker``, ``both`` and ``node`` failures count too."""
    max_preemptions: int = field(default=-1, metadata=opt('--max-preemptions', 'Failures and restarts',
            help='Restarts after a preemption notice (a node drained with a deadline) before the run fails (-1: '
            'unlimited); counted apart from --max-worker-failures.'))
    """Worker-group restarts after a preemption (Ray Train's ``FailureConfig.max_preemption_failures``), counted
    apart from ``max_worker_failures`` (-1: unlimited); a shadow shard or persister moved off a draining node does
    not count against ``max_shadow_restarts`` / ``max_persister_restarts`` either."""
    max_in_process_restarts: int = field(default=3, metadata=opt('--max-in-process-restarts', 'Failures and restarts', min=0,
            help='zo only (ignored by --algo fo), one worker: a step that raises (the process alive) is '
            'rolled back to the freshest state in the same process and re-executed, without a Ray Train'
            ' restart, at most this many times per worker process; then (or with 0) Ray Train restarts '
            'the worker.'))
    """ZO (ignored by ``algo`` fo), one worker: in-process restarts per worker process (``training.in_process``): a step that raises
    is rolled back to the freshest complete state in the same process and re-executed, without a Ray Train
    restart; once spent (or 0: off), a failure goes to Ray Train as before (``max_worker_failures``)."""
    warm_standby: bool | None = field(default=None, metadata=opt('--warm-standby', 'Failures and restarts',
            help='Keep a loaded standby executor per worker, promoted when the executor\'s process dies (no Ray Train '
            'restart; counts against --max-worker-failures). Default: where it pays, by measurement (the console says '
            'why); on or off forces it.'))
    """A warm standby per rank (``workers.standby``): the Ray Train worker supervises a step executor actor and,
    where it pays, a second one loaded and waiting; when the executor's process dies the standby takes over
    without a Ray Train restart. Each promotion counts against ``max_worker_failures``. None (default): where
    the run can keep one (``JobConfig.standby_refusal``), each rank measures its executor's cold start and
    memory and keeps a standby where ``policies.standby.standby_decision`` says it pays; True: always (refused
    where the run cannot keep one); False: never (the worker trains in Ray Train's own process)."""
    recovery_timeout_s: float = 600.0
    """Seconds a recovery may take before the run fails."""
    start_timeout_s: float = field(default=300.0, metadata=opt('--start-timeout', 'Shadow and placement', min=1, unit="s",
            help='Seconds the persister and each shadow shard may take to start before the run fails.'))
    """Seconds the snapshot persister and each shadow shard may take to start (be placed on a node and
    construct) before the run fails, naming the component."""

    def __post_init__(self) -> None:
        for name in ("max_shadow_restarts", "max_persister_restarts", "max_worker_failures", "max_preemptions"):
            if getattr(self, name) < -1:
                raise ValueError(f"faults.{name} must be >= 0, or -1 for unlimited, got {getattr(self, name)}")
        if self.max_in_process_restarts < 0:
            raise ValueError(f"faults.max_in_process_restarts must be >= 0 (0: off), got {self.max_in_process_restarts}")
        _require_positive("faults.recovery_timeout_s", self.recovery_timeout_s)
        _require_positive("faults.start_timeout_s", self.start_timeout_s)
        if -1 < self.max_worker_failures < self.injected_worker_failures:
            raise ValueError(f"{self.injected_worker_failures} injected worker failures exceed faults.max_worker_failures "
                             f"{self.max_worker_failures}: raise --max-worker-failures (-1: unlimited)")

    @property
    def injected_worker_failures(self) -> int:
        """How many of ``failures`` end a train worker (``worker``, ``both``, ``node``)."""
        return sum(1 for f in self.failures if f.target in ("worker", "both", "node"))


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """ZO with a step log: the worker count may shrink when a node is lost and grow back (docs/elastic.md)."""

    min_workers: int = field(default=0, metadata=opt('--min-workers', 'Failures and restarts', min=0,
            help='zo: elastic: go on with as few as this many workers when a node is lost, grow back to '
            '--workers when the cluster can place them (bitwise the same trajectory; docs/elastic.md). '
            '0: a fixed --workers.'))
    """Fewest train workers the run goes on with (Ray Train elastic ``ScalingConfig(num_workers=(min_workers,
    workers))``): when a node is lost and no replacement can be placed, training continues on fewer workers
    and grows back to ``workers`` when the cluster can place them; the trajectory stays the same bits
    (``zo.micro_batch_size``). 0: a fixed ``workers``."""
    resize_interval_s: float = field(default=60.0, metadata=opt('--elastic-resize-interval', 'Failures and restarts', metavar='DURATION', unit="s", type=str, parse=parse_duration, show=duration_text,
            help='With --min-workers: how often Ray Train checks whether more workers can be placed, e.g. '
            '60s.'))
    """With ``min_workers``: seconds between Ray Train's checks whether more workers can be placed
    (``ScalingConfig.elastic_resize_monitor_interval_s``)."""

    def __post_init__(self) -> None:
        _require_positive("elastic.resize_interval_s", self.resize_interval_s)
        if self.min_workers < 0:
            raise ValueError(f"elastic.min_workers must be >= 0 (0: a fixed worker count), got {self.min_workers}")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What a run trains on: the data file (or the built-in snippets), the task, and how a row becomes a
    prompt (``training.data``). The file itself is read on the driver only (``training.data.load_data_file``)."""

    path: str = field(default="", metadata=opt('--data', 'Run', metavar='FILE', parse=absolute,
            help='Training data: a local .jsonl, .csv or .parquet file (default: the Rotten Tomatoes '
            'snippets); every 10th row is held out.'))
    """A local JSONL, CSV or Parquet file (read on the driver only, ``training.data.load_data_file``);
    empty: the Rotten Tomatoes snippets."""
    sha256: str = ""
    """sha256 of the data file's bytes, set by the driver; part of the trajectory."""
    task: str = field(default="classification", metadata=opt('--task', 'Data and task', metavar='classification|causal-lm',
            help='classification (a prompt scored by its label words) or causal-lm (loss on the completion '
            'tokens; needs --data).'))
    """``classification`` (a prompt scored by its label words) or ``causal-lm`` (token loss on the
    completion: prompt/completion columns, or one text column); ``causal-lm`` needs ``path``."""
    text_column: str = field(default="text", metadata=opt('--text-column', 'Data and task', metavar='COLUMN',
            help='Column of the text (classification; causal-lm without prompt/completion).'))
    label_column: str = field(default="label", metadata=opt('--label-column', 'Data and task', metavar='COLUMN',
            help='Classification: column of the label (a label word or its 0-based index).'))
    """Classification: the label of a row is a label word or its 0-based index in ``label_words``."""
    label_words: str = field(default=",".join(w.strip() for w in LABEL_WORDS), metadata=opt('--label-words', 'Data and task', metavar='WORDS',
            help='Classification: label words, comma-separated.'))
    """Classification: the label words, comma-separated (each scored with a leading space)."""
    prompt_template: str = field(default=PROMPT, metadata=opt('--prompt-template', 'Data and task', metavar='TEXT', parse=typed_newlines, show=shown_newlines,
            help='Classification: the prompt, {text} standing for the text and \\n (backslash n, as typed) '
            'for a newline.'))
    """Classification: the prompt, ``{text}`` standing for the text column (once)."""
    prompt_column: str = field(default="prompt", metadata=opt('--prompt-column', 'Data and task', metavar='COLUMN',
            help='Causal LM: column of the prompt.'))
    completion_column: str = field(default="completion", metadata=opt('--completion-column', 'Data and task', metavar='COLUMN',
            help='Causal LM: column of the completion (the tokens the loss is on).'))
    """Causal LM: the columns of a prompt/completion file (loss on the completion tokens); a file with
    only ``text_column`` is trained on all of its tokens."""

    def __post_init__(self) -> None:
        """Validate the task, label words and prompt template (not the file: the driver reads that)."""
        if self.task not in TASKS:
            raise ValueError(f"data.task {self.task!r}: choose one of {', '.join(TASKS)}")
        if self.task == "causal-lm" and not self.path:
            raise ValueError("data.task causal-lm needs a data file (--data FILE with prompt/completion or text columns)")
        words = [w.strip() for w in self.label_words.split(",")]
        if len(words) < 2 or not all(words) or len(set(words)) != len(words):
            raise ValueError(f"data.label_words {self.label_words!r}: give two or more distinct words, comma-separated, "
                             "e.g. negative,positive")
        if self.prompt_template.count("{text}") != 1:
            raise ValueError(f"data.prompt_template {self.prompt_template!r} must contain {{text}} exactly once")


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Where the run's processes go and how the shadow is split: none of it is part of the trajectory
    (``orchestrator.cluster.plan_placement``, ``actors.shards``)."""

    worker_resource: str = field(default="", metadata=opt('--worker-resource', 'Shadow and placement', metavar='RESOURCE',
            help='Ray custom resource each train worker asks one unit of (places the workers on the nodes '
            'offering it).'))
    """A Ray custom resource each train worker asks one unit of (besides its CPU or GPU), placing the
    workers on the nodes that offer it; empty: any node (``orchestrator.cluster.plan_placement``)."""
    shadow_resource: str = field(default="", metadata=opt('--shadow-resource', 'Shadow and placement', metavar='RESOURCE',
            help='Ray custom resource each shadow shard and the snapshot persister ask one unit of. Default:'
            ' on 2+ nodes, off every node that can host a train worker.'))
    """A Ray custom resource each shadow shard and the snapshot persister ask one unit of; empty: on
    a cluster of two or more nodes, off every node that could host a train worker (``plan_placement``)."""
    shadow_shards: int = field(default=1, metadata=opt('--shadow-shards', 'Shadow and placement', min=1,
            help='Split the shadow into K CPU actors, each replaying a contiguous range of units '
            '(embeddings, layers, norm, head) balanced by size, spread across nodes: replay work and '
            "memory per actor / K. 1..the model's unit count (tiny: 4, smollm2-135m: 32); --fail "
            'STEP:shadow:N kills shard N only.'))
    """CPU actors the shadow is split into (``actors.shards``): each holds and replays a contiguous
    range of units, 1..the model's unit count (checked against the model by ``actors.shards.split_units``)."""
    shadow_threads: int = field(default=1, metadata=opt('--shadow-threads', 'Shadow and placement', min=1,
            help='Threads of each shadow actor (each shard): its replay splits large tensors over them, the '
            'same bits on any count. `raycheck policy --elements --replay-rate` says how many cores '
            'keep up.'))
    """Threads of each shadow actor (each shard): its replay splits every large tensor over them
    (``training.noise``; the same bits on any count). Size them with ``raycheck policy --elements
    --replay-rate``; the actors ask Ray for no CPU, so leave the cores they use free of workers."""
    shadow_env: dict[str, str] = field(default_factory=dict, metadata=opt('--shadow-env', 'Shadow and placement', metavar='KEY=VALUE', type=list[str], parse=parse_env, show=env_pairs,
            help="KEY=VALUE set in the shadow actor's process (Ray runtime_env), e.g. "
            'ATEN_CPU_CAPABILITY=default. Repeatable.'))
    """Environment variables of the shadow actor's process (Ray ``runtime_env`` ``env_vars``), e.g.
    ``{"ATEN_CPU_CAPABILITY": "default"}`` or numba/torch settings of a node type; empty: inherit."""

    def __post_init__(self) -> None:
        _require_at_least("placement", self, ("shadow_shards", "shadow_threads"), 1)
        for key, value in self.shadow_env.items():
            if not (isinstance(key, str) and ENV_NAME.match(key) and isinstance(value, str)):
                raise ValueError(f"placement.shadow_env {key!r}={value!r}: expected NAME=VALUE, NAME letters, digits and _ "
                                 "(not starting with a digit)")


COMPONENTS = {"data": DataConfig, "placement": PlacementConfig, "zo": ZOConfig, "fo": FOConfig, "layerwise": LayerwiseConfig, "differential": DifferentialConfig,
              "overlapped": OverlappedConfig, "snapshot": SnapshotConfig, "storage": StorageConfig, "faults": FaultConfig,
              "elastic": ElasticConfig}
"""``JobConfig``'s components by field name: each a frozen dataclass that validates its own fields."""


class OldConfigError(ValueError):
    """A configuration in the flat form of raycheck before its components (``JobConfig.from_dict``)."""


def refuse_flat(d: dict[str, Any]) -> None:
    """Raise ``OldConfigError`` (one line) when ``d``, a configuration as ``config.json`` holds it, is in
    the flat form of raycheck before its components: its ``storage`` is a string, the URI (the flat form
    always held one there)."""
    if isinstance(d.get("storage"), str):
        raise OldConfigError("configuration written by an older raycheck (flat fields such as storage, snapshot_every); "
                             "this raycheck reads only the nested form (storage.uri, snapshot.every_steps): resume the run "
                             "with the raycheck that started it, or start it anew")


NESTED_NAMES = {"data": "data.path", "data_sha256": "data.sha256", "task": "data.task", "text_column": "data.text_column",
                "label_column": "data.label_column", "label_words": "data.label_words", "prompt_template": "data.prompt_template",
                "prompt_column": "data.prompt_column", "completion_column": "data.completion_column",
                "worker_resource": "placement.worker_resource", "shadow_resource": "placement.shadow_resource",
                "shadow_shards": "placement.shadow_shards", "shadow_threads": "placement.shadow_threads",
                "shadow_env": "placement.shadow_env"}
"""The run-level fields of raycheck before its ``data`` and ``placement`` components, by name -> their path now."""


def nest_data_and_placement(d: dict[str, Any]) -> dict[str, Any]:
    """``d``, a configuration as ``config.json`` holds it, with the fields that an earlier raycheck kept at the
    top level (``NESTED_NAMES``: ``data`` as the file's path, ``task``, ``shadow_shards``, ...) moved into the
    ``data`` and ``placement`` components, so that a run it started resumes here (its trajectory hash is the
    same); ``d`` itself when it holds none of them."""
    flat = {name: value for name, value in d.items() if name in NESTED_NAMES and not (name == "data" and isinstance(value, dict))}
    if not flat:
        return d
    nested: dict[str, Any] = {name: value for name, value in d.items() if name not in flat}
    for name, value in flat.items():
        component, _, leaf = NESTED_NAMES[name].partition(".")
        nested[component] = {**nested.get(component, {}), leaf: value}
    return nested


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Everything a run needs: run-level fields, and one frozen component per concern (``COMPONENTS``:
    ``data``, ``placement``, ``zo``, ``fo``, ``layerwise``, ``differential``, ``overlapped``, ``snapshot``, ``storage``,
    ``faults``, ``elastic``), each validating its own fields; the checks across components are here. It describes
    and validates a run; the objects it describes are built elsewhere (``job.stores``, ``job.names``). A field is named
    by its path, e.g. ``layerwise.threshold`` (``get``). Fields that change the training trajectory are
    listed in ``TRAJECTORY``. A component may be given as a dict of its fields (the others at their
    defaults), as ``config.json`` holds it; ``replace`` takes dicts of changes."""

    out_dir: str
    """Run directory: step log, snapshots (by default), events, metrics, summary."""
    cache_dir: str = field(metadata=opt('--cache-dir', 'Snapshots, step log and storage', metavar='DIR', type=pathlib.Path, parse=absolute,
            help='Converted-model cache.'))
    """Where converted models live (see ``training.model.default_cache_dir``)."""
    model: str = field(default="smollm2-135m", metadata=opt('--model', 'Run', metavar='NAME|DIR', parse=model_arg,
            help=f"Model: {', '.join(MODEL_NAMES)}, "
            'a local Hugging Face model folder (config.json + *.safetensors) or a model id in the local'
            ' Hugging Face cache (never downloaded).'))
    """A built-in name (``smollm2-135m``, ``tiny``), a local Hugging Face model folder, or a model id in
    the local Hugging Face cache (``training.model.model_folder``; read on the driver only)."""
    model_sha256: str = ""
    """sha256 of the model folder's files (``training.model.files_sha256``), set by the driver
    (``orchestrator.api.check_job``); empty for a built-in name. Part of the trajectory."""
    data: DataConfig = field(default_factory=DataConfig)
    algo: str = field(default="zo", metadata=opt('--algo', 'Run', metavar='zo|fo',
            help='zo (MeZO, zeroth-order, with a step log) or fo (AdamW, first-order).'))
    """``zo`` (MeZO, zeroth-order, the step log) or ``fo`` (AdamW, first-order)."""
    strategy: str = field(default="", metadata=opt('--strategy', 'Run', metavar='NAME',
            help='Checkpointing strategy. zo: shadow (step log + CPU shadow + snapshots, default), '
            'full-sync, full-async, log-only; fo: layerwise (default), differential, overlapped, '
            'full-sync, full-async. full-* and overlapped checkpoint every --snapshot-every steps.'))
    """How progress is made durable: one of ``STRATEGIES[algo]``; empty: ``shadow`` for ``zo``,
    ``layerwise`` for ``fo``."""
    steps: int = field(default=50, metadata=opt('--steps', 'Run', min=1, unit="steps",
            help='Training steps.'))
    batch_size: int = field(default=8, metadata=opt('--batch-size', 'Data and task', min=1, unit="examples",
            help='Samples per step (split across workers).'))
    seq_len: int = field(default=32, metadata=opt('--seq-len', 'Data and task', min=8, unit="tokens",
            help='Maximum prompt length in tokens.'))
    seed: int = field(default=0, metadata=opt('--seed', 'Data and task', metavar='N',
            help='Run seed (batches and perturbations).'))
    workers: int = field(default=1, metadata=opt('--workers', 'Run', min=1,
            help='Ray Train workers (data parallel, gloo).'))
    torch_threads: int = field(default=1, metadata=opt('--torch-threads', 'Zeroth-order (MeZO)', min=1,
            help='Torch threads per worker (fixed for reproducibility).'))
    """Torch threads per worker, fixed so forward passes are reproducible across restarts."""
    weight_decay: float = field(default=0.0, metadata=opt('--weight-decay', 'Zeroth-order (MeZO)',
            help='Weight decay for matrices.'))
    """Weight decay of the matrices (>= 0), in both optimisers (MeZO's update, AdamW's decoupled decay)."""
    zo: ZOConfig = field(default_factory=ZOConfig)
    fo: FOConfig = field(default_factory=FOConfig)
    layerwise: LayerwiseConfig = field(default_factory=LayerwiseConfig)
    differential: DifferentialConfig = field(default_factory=DifferentialConfig)
    overlapped: OverlappedConfig = field(default_factory=OverlappedConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    eval_samples: int = field(default=200, metadata=opt('--eval-samples', 'Data and task', min=0,
            help='Held-out snippets scored before and after (0: skip).'))
    """Held-out snippets scored before and after training (0 skips evaluation)."""
    hash_every_steps: int = field(default=0, metadata=opt('--hash-every', 'Zeroth-order (MeZO)', min=0, unit="steps",
            help='Record worker and shadow state sha256 every N steps (a sharded shadow records none: a '
            'shard holds part of the state; its final shadow_state_sha256 is still compared).'))
    """Record the worker's and shadow's state sha256 every this many steps (0: only at the end)."""
    run_id: str = "run"
    writer_epoch: int = 0
    """This driver incarnation's writer epoch in the snapshot index (``SnapshotStore.claim_epoch``, set
    by the controller at each start and ``--resume``); writers of an older one are fenced."""
    namespace: str = "raycheck"
    device: str = field(default="cpu", metadata=opt('--device', 'Run', metavar='cpu|cuda',
            help='zo: where the workers compute, cpu or cuda (one GPU per worker; the step log and the '
            'shadow stay on the CPU; see scripts/device-check).'))
    """Where the ZO workers compute: ``cpu`` or ``cuda`` (one GPU per worker, Ray Train ``use_gpu``). The
    step log, the shadow and snapshots stay on the CPU; the forward passes differ between devices, so
    the device is part of the trajectory (``trajectory_sha256``) when it is not ``cpu``."""
    dtype: str = field(default="float32", metadata=opt('--dtype', 'Run', metavar='float32|bfloat16|float16',
            help='zo: the dtype the workers hold and perturb the parameters in: float32, bfloat16 or float16'
            ' (half the memory; the shadow, recoveries and replay use the same one, bitwise: see '
            'docs/dtypes.md). algo fo trains in float32.'))
    """The dtype the ZO workers hold and perturb the parameters in (``DTYPE_NAMES``: float32,
    bfloat16, float16); the shadow, recoveries, snapshots and ``raycheck replay`` use the same one (the
    step log header records it). Part of the trajectory (``trajectory_sha256``) when it is not float32."""
    durability: str = field(default="node", metadata=opt('--durability', 'Snapshots, step log and storage', metavar='process|node|cluster',
            help="zo step log: a step is durable before its update when fsynced on rank 0's node (process), "
            "also acknowledged by the log keeper on the driver's node (node), or also uploaded to the "
            'remote --storage (cluster, group commit).'))
    """When a step's record counts as durable (before its update): ``process`` (fsynced in rank 0's
    node-local log; sent to the log keeper without waiting) or ``node`` (also acknowledged by the log
    keeper on the driver's node; survives the loss of rank 0's node when that is another node) or
    ``cluster`` (also in the remote storage, ``JobConfig.storage``, as a log segment, uploaded by the keeper with group
    commit; survives the loss of every node)."""
    scratch_dir: str = field(default="", metadata=opt('--scratch-dir', 'Snapshots, step log and storage', metavar='DIR',
            help="Node-local directory for rank 0's own step log (default: a per-run directory under the "
            'system temp dir; never the run directory).'))
    """Node-local directory of rank 0's own step log (never the run directory); empty: a per-run
    directory under the system temp directory (``default_scratch_dir``)."""
    extra: dict[str, Any] = field(default_factory=dict)

    TRAJECTORY = ("model", "algo", "steps", "batch_size", "seq_len", "seed", "zo.lr", "zo.eps", "weight_decay", "workers",
                  "torch_threads", "fo.lr", "fo.max_grad_norm")
    """The paths of the fields that determine the trajectory (``trajectory_sha256`` adds the conditional ones)."""

    DATA_TRAJECTORY = {"model_sha256": "model_sha256", "data_sha256": "data.sha256", "task": "data.task",
                       "text_column": "data.text_column", "label_column": "data.label_column", "label_words": "data.label_words",
                       "prompt_template": "data.prompt_template", "prompt_column": "data.prompt_column",
                       "completion_column": "data.completion_column"}
    """Trajectory fields counted only away from their defaults (at a default, a field adds nothing to the hash), by the
    key the hash names each one with (the field's name before ``DataConfig``, so that no run's hash changed) -> its path."""

    def __post_init__(self) -> None:
        for name, kind in COMPONENTS.items():  # a dict (config.json, a caller's shorthand) becomes its component
            if isinstance(getattr(self, name), dict):
                given = dict(getattr(self, name))
                if name == "faults":
                    given["failures"] = tuple(f if isinstance(f, FailureSpec) else FailureSpec(**f) for f in given.get("failures", ()))
                object.__setattr__(self, name, kind(**given))
            elif not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__} or a dict of its fields, got {type(getattr(self, name)).__name__}")
        if not self.model:
            raise ValueError("model is empty: give smollm2-135m, tiny, a model folder or a cached model id")
        self._check_data()
        for name in ("steps", "batch_size", "seq_len", "workers", "torch_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        for name in ("eval_samples", "hash_every_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.algo not in ALGOS:
            raise ValueError(f"algo {self.algo!r}: choose one of {', '.join(ALGOS)}")
        if not self.strategy:
            object.__setattr__(self, "strategy", DEFAULT_STRATEGY[self.algo].value)  # a plain str, as config.json holds it
        if self.strategy not in STRATEGIES[self.algo]:
            raise ValueError(f"strategy {self.strategy!r} for algo {self.algo}: choose one of {', '.join(STRATEGIES[self.algo])}")
        if self.placement.shadow_shards > 1 and not self.uses_shadow:
            raise ValueError(f"placement.shadow_shards {self.placement.shadow_shards} needs strategy shadow (this run: {self.strategy})")
        self._check_groups()
        self._check_elastic()
        self._check_failures()
        if not self.storage.uri:
            object.__setattr__(self, "storage", dataclasses.replace(self.storage, uri=str(pathlib.Path(self.out_dir) / "snapshots")))
        self._check_node_failures()
        if self.durability not in DURABILITIES:
            raise ValueError(f"durability {self.durability!r}: choose one of {', '.join(DURABILITIES)}")
        if self.durability == "cluster" and not self.storage.remote:
            raise ValueError(f"durability cluster needs a remote storage (s3://BUCKET/PREFIX) to put each step record in "
                             f"before its update, not the local path {self.storage.uri} (or choose durability node)")
        if not self.scratch_dir:
            object.__setattr__(self, "scratch_dir", default_scratch_dir(self.out_dir, self.run_id))
        run_dir, scratch = pathlib.Path(self.out_dir).absolute(), pathlib.Path(self.scratch_dir).absolute()
        if scratch == run_dir or run_dir in scratch.parents:  # rank 0's log would be the log keeper's file
            raise ValueError(f"scratch_dir {self.scratch_dir} is inside the run directory {self.out_dir}: rank 0's "
                             "node-local step log must live elsewhere (e.g. leave --scratch-dir out for the default)")
        if self.snapshot.policy == "adaptive" and not self.uses_shadow:  # the cost model plans a shadow's snapshots
            raise ValueError(f"snapshot.policy adaptive plans the shadow's snapshots: it needs algo zo with strategy shadow "
                             f"(this run: {self.algo} {self.strategy}); set a fixed interval with snapshot.every_steps")
        self._check_fo()
        self._check_runtime()

    def _check_failures(self) -> None:
        """Validate the injected failures against the run: its steps, strategy, shards and workers."""
        for f in self.faults.failures:
            if f.step >= self.steps:
                raise ValueError(f"failure at step {f.step} is past the last step ({self.steps - 1}; --fail counts steps from 0, "
                                 f"0..{self.steps - 1} for {self.steps} steps)")
            if f.target in ("shadow", "both") and not self.uses_shadow:
                raise ValueError(f"failure {f.step}:{f.target} kills the shadow, which only strategy shadow has (this run: {self.strategy})")
            if f.shard is not None and f.shard >= (shards := self.placement.shadow_shards):
                raise ValueError(f"failure {f.step}:shadow:{f.how} names shard {f.how}, but the shadow has "
                                 f"{shards} shard(s) (0..{shards - 1}): set --shadow-shards")
            if f.how == "torn" and not self.uses_step_log:
                raise ValueError(f"failure {f.step}:worker:torn tears a step-log record; strategy {self.strategy} has no step log")
            if f.how == "torn" and self.workers > 1:
                raise ValueError(f"failure {f.step}:worker:torn tears rank 0's step-log append, but worker failures hit the last "
                                 f"rank ({self.workers - 1}), which has no log writer: use workers=1 or another HOW")

    def _check_data(self) -> None:
        """Validate the task against the algorithm (``DataConfig`` checks its own fields)."""
        if self.data.task == "causal-lm" and self.algo != "zo":
            raise ValueError(f"data.task causal-lm runs with algo zo only, not algo {self.algo}")

    def _check_node_failures(self) -> None:
        """A ``node`` or ``preempt`` failure loses whatever that node stored itself: refuse a storage on a local path."""
        for f in self.faults.failures:
            if f.target in ("node", *PREEMPT_TARGETS) and node_local(self.storage.uri):
                node = "the shadow's node" if f.target == "preempt-shadow" else "rank 0's node"
                raise ValueError(f"failure {f.step}:{f.target} takes down {node} with every file on it, but storage "
                                 f"{self.storage.uri!r} is node-local: give --storage a URI every node reaches (s3://BUCKET/PREFIX)")

    def _check_runtime(self) -> None:
        """Validate ``device``, ``dtype`` (both ZO only), ``faults.warm_standby`` (``standby_refusal``) and ``placement.shadow_env``
        (which needs a strategy with a shadow)."""
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r}: choose one of {', '.join(DEVICES)}")
        if self.device != "cpu" and self.algo != "zo":
            raise ValueError(f"device {self.device} runs the ZO worker only (algo zo), not algo {self.algo}")
        if self.faults.warm_standby and (why := self.standby_refusal) is not None:
            raise ValueError(f"faults.warm_standby: this run cannot keep a warm standby: {why}; leave --warm-standby out")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPE_NAMES)}")
        if self.dtype != "float32" and self.algo != "zo":
            raise ValueError(f"dtype {self.dtype} is for the ZO path (algo zo) only: algo {self.algo} (AdamW, its moments and "
                             "gradient records) trains in float32; leave dtype out or use algo zo")
        if self.placement.shadow_env and not self.uses_shadow:
            raise ValueError(f"placement.shadow_env is set, but strategy {self.strategy} has no shadow")

    def _check_groups(self) -> None:
        """Validate ``zo.micro_batch_size`` (ZO only) against ``batch_size`` and ``workers`` (``example_group_size``)."""
        micro = self.zo.micro_batch_size
        if micro and self.algo != "zo":
            raise ValueError(f"zo.micro_batch_size is for the ZO path (algo zo) only: algo {self.algo} splits batch_size evenly "
                             "over the workers; leave zo.micro_batch_size out or use algo zo")
        if not micro:
            if self.batch_size % self.workers:
                raise ValueError(f"batch_size ({self.batch_size}) must be divisible by workers ({self.workers})"
                                 + (", or set zo.micro_batch_size" if self.algo == "zo" else ""))
            return
        if self.batch_size % micro:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of zo.micro_batch_size ({micro})")
        if self.batch_size // micro < self.workers:
            raise ValueError(f"batch_size {self.batch_size} in micro-batches of {micro} gives "
                             f"{self.batch_size // micro} example group(s), fewer than workers ({self.workers}): "
                             f"set zo.micro_batch_size to at most {self.batch_size // self.workers}")

    def _check_elastic(self) -> None:
        """Validate ``elastic.min_workers`` against ``workers``, ``algo`` and ``strategy``."""
        min_workers = self.elastic.min_workers
        if not min_workers <= self.workers:
            raise ValueError(f"elastic.min_workers must be in [1, workers ({self.workers})], or 0 for a fixed worker count, got {min_workers}")
        if self.is_elastic and not (self.algo == "zo" and self.uses_step_log):
            raise ValueError(f"elastic.min_workers {min_workers} (elastic) needs algo zo with a step log (strategy shadow or "
                             f"log-only): only their losses do not depend on the worker count (this run: {self.algo} {self.strategy})")

    @property
    def is_elastic(self) -> bool:
        """The worker count may change during the run (``elastic.min_workers`` below ``workers``)."""
        return 0 < self.elastic.min_workers < self.workers

    @property
    def example_group_size(self) -> int:
        """Examples per example group of a ZO step (``training.groups``): ``zo.micro_batch_size``, else
        ``batch_size // workers``."""
        return self.zo.micro_batch_size or self.batch_size // self.workers

    def _check_fo(self) -> None:
        """Validate ``fo.parallelism`` and the strategies' intervals against the algorithm and the strategy."""
        every = self.snapshot.every_steps
        if self.fo.parallelism == "fsdp2" and self.algo != "fo":
            raise ValueError(f"fo.parallelism fsdp2 (sharded state) is a first-order option (algo fo); algo {self.algo} "
                             "runs every worker on the whole state: leave fo.parallelism out or use algo fo")
        if self.strategy in (*FULL_STATE, RunStrategy.LAYERWISE, RunStrategy.OVERLAPPED) and every < 1:
            raise ValueError(f"strategy {self.strategy} checkpoints every snapshot.every_steps steps: it must be >= 1, got {every}")
        if self.strategy == RunStrategy.OVERLAPPED and self.overlapped.chunks > every >= 1:
            raise ValueError(f"overlapped.chunks ({self.overlapped.chunks}) exceeds snapshot.every_steps ({every}): a snapshot is "
                             "staged over overlapped.chunks steps, and its window must end before the next one is due; "
                             f"set overlapped.chunks to at most {every}")

    def get(self, path: str) -> object:
        """The field at ``path``: a run-level name (``steps``) or ``component.name`` (``layerwise.threshold``).

        Raises:
            AttributeError: no such field.
        """
        value: object = self
        for name in path.split("."):
            value = getattr(value, name)
        return value

    @classmethod
    def default(cls, path: str) -> object:
        """The default of the field at ``path`` (``steps``, ``layerwise.threshold``); ``dataclasses.MISSING`` for
        ``out_dir`` and ``cache_dir``, which have none.

        Raises:
            KeyError: no such field.
        """
        spec = field_spec(cls, path)
        return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default

    @classmethod
    def field_paths(cls) -> tuple[str, ...]:
        """Every field's path, run-level names and each component's ``component.name``, in declaration order."""
        return tuple(f"{f.name}.{c.name}" if f.name in COMPONENTS else f.name
                     for f in dataclasses.fields(cls) for c in (dataclasses.fields(COMPONENTS[f.name]) if f.name in COMPONENTS else [f]))

    def trajectory_sha256(self) -> str:
        """Hash of the fields that determine the trajectory, keyed by path: equal hashes, comparable runs.
        ``device`` counts only when it is not ``cpu``, ``dtype`` only when it is not ``float32``,
        ``fo.parallelism`` only when it is not ``ddp`` (and then ``workers`` does not count: a run resumes
        at another), and ``DATA_TRAJECTORY`` fields (the model's and data's content hashes, the task) only
        away from their defaults. With ``zo.micro_batch_size`` set, the example groups replace ``workers``:
        runs of one trajectory on any worker count share a hash."""
        values = {path: self.get(path) for path in self.TRAJECTORY}
        if self.zo.micro_batch_size:  # the groups, not the worker count, set the losses (training.groups)
            values.pop("workers")
            values["zo.micro_batch_size"] = self.zo.micro_batch_size
        if self.fo.parallelism != "ddp":  # sharded state reshards: the worker count may change within the run
            values.pop("workers", None)
            values["fo.parallelism"] = self.fo.parallelism
        values.update({key: self.get(path) for key, path in self.DATA_TRAJECTORY.items() if self.get(path) != self.default(path)})
        if self.device != "cpu":
            values["device"] = self.device
        if self.dtype != "float32":
            values["dtype"] = self.dtype
        return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """The nested form (``config.json``): run-level fields, and each component as a dict of its fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JobConfig":
        """The configuration ``to_dict`` gave; the form of an earlier raycheck, whose data and placement fields
        were at the top level, is read too (``nest_data_and_placement``).

        Raises:
            OldConfigError: ``d`` is in the flat form of raycheck before its components (its
                ``storage`` a string, the URI).
            ValueError, TypeError: a field no run can use, or an unknown one.
        """
        refuse_flat(d)
        return cls(**nest_data_and_placement(d))

    def replace(self, **changes: object) -> "JobConfig":
        """A copy with ``changes``: run-level fields by name; a component by name, as a dict of the
        fields to change in it (the others kept) or as a whole component; or a component's field by its
        path. E.g. ``cfg.replace(steps=5, layerwise={"threshold": 0.1})``, or
        ``cfg.replace(**{"faults.max_shadow_restarts": 3})``.

        Raises:
            TypeError: an unknown field; ValueError: a value no run can use.
        """
        nested: dict[str, object] = {}
        for name, value in changes.items():
            component, _, leaf = name.rpartition(".")
            if component:
                name, value = component, {leaf: value}
            if name in COMPONENTS and isinstance(value, dict):
                current: Any = nested.get(name, getattr(self, name))
                value = dataclasses.replace(current, **value)
            nested[name] = value
        return dataclasses.replace(self, **nested)  # type: ignore[arg-type]

    @property
    def uses_shadow(self) -> bool:
        """True when a CPU shadow replays the step log (strategy ``shadow``)."""
        return self.strategy == RunStrategy.SHADOW

    @property
    def uses_step_log(self) -> bool:
        """True when every step is appended to the durable step log (``shadow``, ``log-only``)."""
        return self.algo == "zo" and self.strategy in STEP_LOG

    @property
    def own_model(self) -> bool:
        """The model is your own ``torch.nn.Module``, trained by your own loop (``orchestrator.api.run_own_loop``;
        ``model`` is ``OWN_MODEL_PREFIX`` + its class name)."""
        return self.model.startswith(OWN_MODEL_PREFIX)

    @property
    def standby_refusal(self) -> str | None:
        """Why this run's workers cannot keep a warm standby (``workers.standby``), None where they can: a step
        executor runs outside Ray Train's worker group, so it cannot join a torch.distributed group of several
        workers (first-order DDP or FSDP2, ZO without replica groups: elastic or without a step log); and with
        the default (``faults.warm_standby`` None) not on CUDA, where the standby path is not measured yet."""
        if self.own_model:
            return "your own train loop runs in Ray Train's worker process, which a standby process cannot take over"
        if self.workers > 1 and not self.replica_groups:
            what = (f"first-order {'FSDP2' if self.fo.parallelism == 'fsdp2' else 'DDP'}" if self.algo == "fo"
                    else "an elastic run" if self.is_elastic else f"strategy {self.strategy}")
            return (f"{what} with {self.workers} workers all-reduces through one torch.distributed group, "
                    "which a standby process cannot join (a standby needs one worker, or ZO replica groups)")
        if self.device == "cuda" and self.faults.warm_standby is None:
            return "the default keeps no standby on CUDA until scripts/device-check has measured it (--warm-standby forces one)"
        return None

    @property
    def supervised(self) -> bool:
        """The workers train in step executors under a supervisor (``workers.standby``): a standby is possible
        (``standby_refusal`` None) and not turned off."""
        return self.faults.warm_standby is not False and self.standby_refusal is None

    @property
    def replica_groups(self) -> bool:
        """Each train worker is its own Ray Train replica group, so a failure replaces only the failed
        worker (``orchestrator.replica_groups``): ZO runs with a step log and more than one worker, not elastic
        (Ray 2.60 restarts the whole group on a resize: its replica groups and elastic scaling are not integrated)."""
        return self.algo == "zo" and self.uses_step_log and self.workers > 1 and not self.is_elastic


def field_spec(cls: type, path: str) -> dataclasses.Field[Any]:
    """The ``dataclasses.Field`` of ``cls`` (``JobConfig``) at ``path``: a run-level name or ``component.name``.

    Raises:
        KeyError: no such field.
    """
    component, _, name = path.rpartition(".")
    owner = COMPONENTS[component] if component else cls
    fields = {f.name: f for f in dataclasses.fields(owner)}
    if name not in fields or (not component and name in COMPONENTS):
        raise KeyError(path)
    return fields[name]


def default_scratch_dir(out_dir: str, run_id: str) -> str:
    """``<system temp dir>/raycheck-scratch/<run id>-<12 hex digits of the run directory's absolute path>``:
    per run, and apart for two runs of one run id in different directories."""
    where = hashlib.sha256(str(pathlib.Path(out_dir).absolute()).encode()).hexdigest()[:12]
    return str(pathlib.Path(tempfile.gettempdir()) / "raycheck-scratch" / f"{run_id}-{where}")
