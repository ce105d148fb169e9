"""Library logging: structlog bound to a stdlib logger, so the host application's logging config
decides where records go. pgregistry never calls ``structlog.configure()`` or
``logging.basicConfig()``."""

from __future__ import annotations

import logging

import structlog

__all__ = ["get_logger"]


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger writing through ``logging.getLogger(name)``."""
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        logging.getLogger(name),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.KeyValueRenderer(key_order=["event"], sort_keys=True),
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
    )
    return logger
