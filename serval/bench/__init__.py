"""``serval bench``: load tests against a deployed endpoint (``serve``), the offline engine in-process
(``throughput``, ``latency``) and configuration sweeps (``tune``)."""
