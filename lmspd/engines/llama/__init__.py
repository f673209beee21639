"""The embedded llama.cpp engine (llama-cpp-python).

llama-cpp-python's CPU backend runs each ``llama_decode`` in an OpenMP team
(its wheels link libgomp). By default libgomp's workers keep spinning for a
while after every team (``GOMP_SPINCOUNT``, 300,000 iterations: milliseconds
here), so between two decodes a worker holds a core it has no work for.
lmspd's event loop, the only thread that sends a token to its client, runs
exactly then: on a machine whose cores the decode threads fill (``--threads``
equal to the cores), the loop woken for a first token found no core free and
waited for the kernel's next preemption (bench/request_trace.py: ``flush →
loop`` 3.6 ms at p90, 0.4 ms at the median). Passive workers sleep at once
and are woken by the next decode (a few microseconds in a step of several
milliseconds). Set before ``llama_cpp`` is first imported (libgomp reads it
when it is loaded); an ``OMP_WAIT_POLICY`` in the environment wins.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
