"""One node's agent: what it runs (``spec``), refusing to start (``preflight``), starting and
ending its ranks (``ranks``), their output, outcomes and hangs (``output``, ``outcomes``,
``watchdog``), the driver link and its outbox (``driver_link``, ``outbox``), a rendezvous
without the driver (``detached``), system samples (``sampler``), DataFrame partitions
(``partition``), preemption (``node_drain``) and the shared checkpoint directory check
(``checkpoint_reach``).

Runs in: a Spark barrier task's Python worker, or a driver thread in local mode. Started by:
``_backends`` (``run_agent``; ``Agent`` in local mode).
May import: ``_core``, ``_shipping``, ``_wire``, ``_node.host`` and ``_node.pool``; never
``_node.rank`` (as torch elastic's agent knows a worker's entry point and its files, not its
code: the file contract is ``_core.run_dir``).
"""
