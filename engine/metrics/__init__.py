"""Per-request latency statistics, an engine's totals and snapshots, and the loggers that publish them
(no Ray here; see deployments/)."""

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
