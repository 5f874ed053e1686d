"""Inside one rank's process: its bootstrap (``worker``), its pipes to the agent
(``agent_link``), the preemption drain (``drain``) and DeepSpeed's op builds
(``torch_extensions``); ``sparkdist.runtime`` reads this room from user code.

Runs in: one rank's process. Started by: the agent, from the warm pool (``pool``) or cold as
``python -m sparkdist._node.rank.worker``.
May import: ``_core``, ``_wire``, ``_checkpoint`` and ``_node.host``.
"""
