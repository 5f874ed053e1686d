"""The process side of a run, in four rooms by the process each runs in (a DAG: ``host`` <-
``rank`` <- ``pool`` <- ``agent``; a room imports only the rooms before it):

- ``host``: what a host offers every process on it (GPUs, network interfaces, ending process
  trees, signal notices, dying with a parent);
- ``rank``: inside one rank's process (its bootstrap ``worker``, its pipes to the agent, the
  preemption drain, DeepSpeed's op builds);
- ``pool``: the warm pool of torch-imported processes a rank starts from (the zygote, its client,
  the pool, a started rank's handle);
- ``agent``: one per node, in a Spark task or on the driver (its spec, starting and watching the
  ranks, their output and outcomes, the driver link).

Checkpoints are a package of their own (``sparkdist._checkpoint``), which the rank uses.

Imports ``_core``, ``_shipping``, ``_wire`` and ``_checkpoint``; never pyspark (only
``_backends`` does).
"""
