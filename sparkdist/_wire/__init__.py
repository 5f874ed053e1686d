"""What crosses a process boundary: the control channel (``channel``), the Job/Outcome
envelopes (``payload``) and large jobs shipped as files (``captures``).

Imports only ``_core``.
"""
