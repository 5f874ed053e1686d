"""The control channel's sockets: the driver's server (``server``) with its admission of new
connections, its peers and dispatch thread, an agent's client, and liveness both ways.

Runs in: the driver (server, admission, peer, dispatch) and each agent (client). May import:
``_core`` and the rest of ``_wire`` (messages, protocol, frames).
"""
