"""The multi-host lab: N hosts on one machine, for tests that must cross a network.

Each host is a network namespace (its own address and routes), a mount namespace (a private
``/tmp``, its own ``/etc/hosts``) and a UTS namespace (its own host name), on one bridge, plus
one directory every host sees (shared storage). Everything lives inside one
``unshare --net --mount --pid --fork --kill-child`` holder (``holder``): the lab has no route out
of the machine and dies whole with it. The test process outside talks to the holder only over
its pipes (``client``), never over the network.

Non-goals: being a network simulator (no loss models, no bandwidth caps); running without root
or user namespaces (``support`` says why and the tests skip).
"""
