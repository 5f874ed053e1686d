"""The warm pool: a zygote process that has imported torch forks ranks on request (``zygote``,
``zygote_client``), ``pool`` picks a warm start or a cold one, and ``rank_process`` is the
handle on a started rank either way.

Runs in: the agent's process (``pool``, ``zygote_client``, ``rank_process``) and the zygote's
(``zygote``). Started by: the agent, on its first rank.
May import: ``_core``, ``_shipping``, ``_wire``, ``_node.host`` and ``_node.rank`` (the zygote
runs a rank's bootstrap in its forks).
"""
