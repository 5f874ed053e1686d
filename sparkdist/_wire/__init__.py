"""What crosses a process boundary: the control channel's messages (``messages``,
``protocol``, ``fields``, ``frames``) and its sockets (``channel``), the Job/Outcome envelopes
(``payload``), large jobs shipped as files (``captures``) and a detached node's failures
(``detached_failures``).

Imports only ``_core``.
"""
