"""Capturing the add-on's log lines (vLLM's loggers do not propagate to caplog's root)."""

from __future__ import annotations

import logging


class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def warnings_in(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]
