"""Per-request latency statistics, an engine's totals and snapshots, and the loggers that publish them
(no Ray here; see deployments/).

- ``stats``: ``RequestTimes``, ``FinishedRequestStats`` and each step's ``IterationStats`` (TTFT, ITL, ...).
- ``engine_stats``: ``EngineTotals`` (folded from every step) and the ``EngineStats`` snapshot ``get_stats`` returns.
- ``loggers``: the ``StatLogger`` protocol and vLLM's periodic log lines (``LoggingStatLogger``,
  ``SpecDecodingLogging``).
- ``reader``: what ``LLM.get_metrics()`` returns (vLLM's ``Counter``, ``Gauge``, ``Vector``).
"""

from engine.metrics.engine_stats import EngineStats, EngineTotals, SpecDecodingSummary
from engine.metrics.loggers import LoggingStatLogger, SpecDecodingLogging, StatLogger
from engine.metrics.stats import FinishedRequestStats, IterationStats, RequestTimes

__all__ = [
    "EngineStats",
    "EngineTotals",
    "FinishedRequestStats",
    "IterationStats",
    "LoggingStatLogger",
    "RequestTimes",
    "SpecDecodingLogging",
    "SpecDecodingSummary",
    "StatLogger",
]
