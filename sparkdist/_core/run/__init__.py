"""The driver's view of a run, as pure logic: the attempt's state machine (``run_state``), what
an ended attempt says for the next (``attempts``), stragglers, results, the rendezvous
diagnosis and the run's report.

Runs in: the driver (and unit tests), no processes, no sockets. May import: ``_core``.
"""
