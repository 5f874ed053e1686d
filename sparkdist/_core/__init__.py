"""Pure logic: no processes, no sockets, no Spark. Unit-tested in milliseconds.

Here: the ranks' environment (``env``), the error tree (``errors``), version requirements
(``versions``), files and addresses as data, output line splitting (``lines``), tracebacks, the
agent<->rank file contract (``run_dir``) and where a rank sits in the world (``world``). Two
rooms: from the user's options to a plan (``launch``), and the driver's view of a run
(``run``). Imports nothing else of sparkdist.
"""
