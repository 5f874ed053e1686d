"""What a host offers every process on it: its GPUs (``gpus``), its network interfaces
(``interfaces``), ending a process tree (``reaper``), signal notices (``signal_notice``) and
dying with a parent (``parent_death``).

Runs in: any process on a node (agent, zygote, rank) and, for the doctor and local mode, the
driver. Started by: nobody (a library of the rooms above it).
May import: ``_core`` only.
"""
