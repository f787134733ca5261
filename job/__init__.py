"""What a job is, below everything that runs one: its configuration (``job.config``: ``JobConfig``,
``FailureSpec``, the option constants, the actor names derived from a run id) and its run directory's
layout (``job.run_dir``). It imports ``storage`` and ``policies`` only, so ``training``, ``actors`` and
``orchestrator`` all import it downward (``docs/architecture.md``, "Layers")."""
