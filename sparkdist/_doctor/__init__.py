"""The checks behind ``sparkdist doctor``: this machine (``checks``), a Spark cluster
(``spark``), and the table they print (``table``)."""
