"""The throughput benchmark behind ``bench/throughput.py`` (``make bench``); not part of ``fastload``.

``python bench/throughput.py`` puts ``bench/`` first on ``sys.path``, so the scripts beside it
import this package as ``_harness``; the tests load it by path (``tests/conftest.py``). No module
of ``fastload`` imports it. Its modules, in the order of a run:

- ``config``: what a run measures (``BenchConfig``), the pipelines, the warm-up and timed batch
  counts that time the steady state rather than the batches the workers prefetched, and whether a
  split is large enough for a worker count;
- ``backends``: the pipelines under test (torch's loader, the one-line swap, fastload's own over
  files, thread workers, memory, device decoding, hybrid, DALI), each a ``Backend`` in ``BACKENDS``;
- ``timing``: the timing loop: a loader's images/s, CPU time and memory over timed runs, the
  ``full-decode`` reference, and ``run``, which measures every (backend, pipeline, workers) and
  makes one record each;
- ``report``: the table, its legend, the verdict line and the plot;
- ``model``: the ``--model`` mode: a real training step fed by each backend, against the same step
  on data already on the device (the ceiling);
- ``cli``: the command line, ``main``.

Imports point down this list (``report`` before ``timing``, which prints its rows as they come).
"""
