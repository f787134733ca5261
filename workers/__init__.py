"""What the Ray Train workers run (above ``actors``, whose clients they use; below ``orchestrator``, which
starts them): the ZO and first-order train loops (``worker``, ``fo_worker``), the worker's environment
(``worker_env``), its restore (``recovery``), rank 0's node-local step log (``rank0_log``), the failure
injector (``faults``) and the warm standby (``standby``)."""
