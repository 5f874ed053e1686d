"""Pure logic: no processes, no sockets, no Spark. Unit-tested in milliseconds.

Configuration (``config``), placement (``placement``), the ranks' environment (``env``), the
error tree (``errors``), results (``result``), version requirements (``versions``) and output
line splitting (``lines``). Imports nothing else of sparkdist.
"""
