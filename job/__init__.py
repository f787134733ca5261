"""What a job is, below everything that runs one: its configuration (``job.config``: ``JobConfig``,
``FailureSpec``, the option constants), the objects it describes built from it (``job.stores``), its actors' names (``job.names``) and its run directory's
layout (``job.run_dir``). It imports ``storage`` and ``policies`` only, so ``training``, ``actors`` and
``orchestrator`` all import it downward (``docs/architecture.md``, "Layers")."""
