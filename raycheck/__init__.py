"""raycheck: a Ray-based fault-tolerant training orchestrator (MeZO step log, CPU shadow replay,
asynchronous snapshots, exact recovery).

The packages keep the design card's top-level folders (``orchestrator/``, ``actors/``, ``policies/``,
``storage/``, ``training/``, ``experiments/``), ``job/`` (the run's configuration), ``workers/`` (what the Ray
Train workers run) and ``cli/`` (the command line), one layer each (``docs/architecture.md``). This package
maps each of them into the ``raycheck.*`` namespace through a symbolic link of the same name
(``raycheck/storage -> ../storage``), so they import as ``raycheck.storage``, ``raycheck.training``,
... in the repository and installed alike (a wheel holds copies of the folders under ``raycheck/``),
and never collide with other distributions' top-level modules."""
