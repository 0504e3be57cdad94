"""Per-request latency statistics and the loggers that publish them (no Ray here; see deployments/)."""

from engine.metrics.loggers import LoggingStatLogger, StatLogger
from engine.metrics.stats import FinishedRequestStats, IterationStats, RequestTimes

__all__ = ["FinishedRequestStats", "IterationStats", "LoggingStatLogger", "RequestTimes", "StatLogger"]
