"""``serval bench``: load tests against a deployed endpoint (``serve``), the offline engine in-process
(``throughput``, ``latency``, ``perplexity``), configuration sweeps (``tune``) and fault soaks (``soak``).

- ``serve``: ``serval bench serve``; ``serve_args``: its flags; ``request_funcs``: one timed streamed request.
- ``datasets``: request sets (``random``, ``prefix_repetition``, ``sharegpt``).
- ``report``: a run's metrics and goodput; ``plots``: its PNG plots.
- ``throughput``, ``latency``: the offline engine in this process.
- ``perplexity``: a model's perplexity on a fixed public text (Python's pydoc topics), offline engine.
- ``tune``: a sweep of engine settings on a live cluster, the best point under an SLO.
- ``soak``: ``serval bench soak``; ``soak_client``: one request and its fate; ``soak_faults``: the faults and
  after-checks; ``soak_report``: the record and summary.
"""
