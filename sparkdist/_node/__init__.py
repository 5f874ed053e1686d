"""The process side of a run: the per-node agent (``agent``, its ``spec``, with ``preflight``,
``ranks``, ``output``, ``driver_link``, ``watchdog`` and ``outcomes``), ending process trees
(``reaper``), the rank (``worker``), the warm pool (``zygote``, ``pool``), output sending
(``outbox``), GPU discovery (``gpus``), a rank's DataFrame partition (``partition``) and nodes
without the driver's channel (``detached``).

Imports ``_core``, ``_wire`` and ``_shipping``; never pyspark (only ``_backends`` does).
"""
