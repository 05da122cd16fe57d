"""What every object store's options share: the transfer fields' checks and the client settings
(timeouts, connection pool, retries with backoff) built from them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = ["check_transfer_fields", "client_settings"]


def check_transfer_fields(options: Any, min_part_bytes: int, why: str) -> None:
    """ValueError naming the options class and field for a bad ``max_retries``, ``part_bytes``,
    ``concurrency`` or timeout; ``part_bytes`` must be at least ``min_part_bytes`` (``why`` says why)."""
    kind = type(options).__name__
    if not isinstance(options.max_retries, int) or isinstance(options.max_retries, bool) or options.max_retries < 0:
        raise ValueError(f"{kind}.max_retries must be an int >= 0, got {options.max_retries!r}")
    for name in ("part_bytes", "concurrency"):
        value = getattr(options, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{kind}.{name} must be a positive int, got {value!r}")
    if options.part_bytes < min_part_bytes:
        raise ValueError(f"{kind}.part_bytes must be at least {why}, got {options.part_bytes}")
    for name in ("retry_timeout_s", "request_timeout_s", "connect_timeout_s"):
        if not float(getattr(options, name)) > 0:
            raise ValueError(f"{kind}.{name} must be positive, got {getattr(options, name)!r}")


def client_settings(options: Any, endpoint: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(client_options, retry_config)`` of an obstore store for ``options`` (``http://``
    allowed for an explicit ``http://`` endpoint only)."""
    client_options: dict[str, Any] = {
        "timeout": timedelta(seconds=options.request_timeout_s),
        "connect_timeout": timedelta(seconds=options.connect_timeout_s),
        "pool_max_idle_per_host": str(max(16, options.concurrency)),
    }
    if endpoint and endpoint.startswith("http://"):
        client_options["allow_http"] = True
    retry_config = {
        "max_retries": options.max_retries,
        "retry_timeout": timedelta(seconds=options.retry_timeout_s),
        "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2},
    }
    return client_options, retry_config
