"""From the user's options to a plan, as pure logic: the one ``LaunchConfig`` (``config``) and
its checks, placement on the cluster (``placement``), the ranks' numbering host by host
(``numbering``), GPU types and the printable ``LaunchPlan`` (``plan``).

Runs in: the driver, and in each agent (the numbering), with no processes, no sockets, no
Spark. May import: ``_core``.
"""
