# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Passing network faults, one rule for every remote read of `veca_hf.data` and `veca_hf.embedding`.

- Which errors pass: a dropped or refused connection, a timeout or a 5xx answer anywhere in the error's chain
  (`is_transient_network_error`). Anything else (a 404, a corrupt shard) is raised at once.
- How often: `--stream_retries` attempts in a row, the first included; a success starts the count again.
- How long between them: `--stream_retry_wait` seconds, always the same, as `datasets` waits between the retried
  reads of an open shard (which `StreamRetries.configure` sets to the same numbers). A fixed wait keeps the longest
  stall, `(retries - 1) * wait`, what the flags say: while one process waits, the others of a multi-process run wait
  for it in their next collective, whose timeout it must stay below.
- What is logged before each retry: `"<what> failed (<error chain>); retry <n>/<retries - 1> in <wait> s[, <how>]."`,
  with every URL redacted.

The numbers reach every process and DataLoader worker through `datasets.config` (`StreamRetries.configure` in the
main process, before workers fork; `StreamRetries.configured` where they are read).
"""

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import datasets
from transformers.utils import logging

from ..arguments import redact_urls


logger = logging.get_logger(__name__)


def _exception_chain(error: BaseException) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def is_transient_network_error(error: BaseException) -> bool:
    """A dropped or refused connection, a timeout or a 5xx answer anywhere in the chain of `error`."""
    for item in _exception_chain(error):
        status = getattr(item, "status", None) or getattr(getattr(item, "response", None), "status_code", None)
        if isinstance(status, int) and 500 <= status < 600:
            return True
        if isinstance(item, (ConnectionError, TimeoutError)):
            return True
        if type(item).__module__.startswith("aiohttp") and "Response" not in type(item).__name__:
            return True
    return False


def describe_error(error: BaseException) -> str:
    """The chain of `error`, one `Type: message` each, redacted."""
    return redact_urls("; ".join(f"{type(e).__name__}: {str(e)[:200]}" for e in _exception_chain(error)))


def remote_url_in_error(error: BaseException) -> str | None:
    """The remote URL an error (or its causes) names, if any."""
    for item in _exception_chain(error):
        match = re.search(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"]+", str(item))
        if match:
            return match.group(0)
    return None


def safe_cause(error: BaseException) -> BaseException | None:
    """`error`, to chain a redacted error to (`raise ... from safe_cause(error)`), or None when an error of its chain
    names a URL's credentials: a traceback prints every cause."""
    return None if any(redact_urls(str(item)) != str(item) for item in _exception_chain(error)) else error


def redact_error(error: Exception) -> Exception:
    """`error` itself, or when an error of its chain names a URL's credentials, an error of the same type (a
    `RuntimeError` for types that cannot be built from a message) whose message is the redacted chain."""
    if safe_cause(error) is error:
        return error
    try:
        return type(error)(describe_error(error))
    except Exception:  # NOTE: e.g. aiohttp's errors need the request they answer
        return RuntimeError(describe_error(error))


class StreamRetries:
    """
    How streaming survives a flaky network (the rule is in the module docstring): `datasets` retries a failed read
    of an open shard (a dropped connection, a timeout, a 5xx answer) by asking again for the same byte range, so a
    retried read yields exactly the bytes of a clean one; `configure` sets how often and how long it waits, in every
    process and DataLoader worker (they fork after it). The rest of `veca_hf` retries with the same numbers: finding
    each data file and opening the dataset (`call`), reopening a stream where it broke (`is_retried`, `back_off`).

    Args:
        retries (`int`): attempts per read, open or data file before the error is raised.
        wait (`float`): seconds between attempts.
    """

    def __init__(self, retries: int = 20, wait: float = 5.0):
        if retries < 1 or wait < 0:
            raise ValueError(f"--stream_retries {retries} must be >= 1 and --stream_retry_wait {wait} >= 0.")
        self.retries, self.wait = retries, wait

    @classmethod
    def configured(cls) -> "StreamRetries":
        """The retries `configure` set in this process (or in the parent of this DataLoader worker); `datasets`'
        defaults where nothing was configured."""
        return cls(datasets.config.STREAMING_OPEN_MAX_RETRIES, datasets.config.STREAMING_OPEN_RETRY_INTERVAL)

    def configure(self) -> None:
        """Set `datasets`' streaming retries, add the URL to its retry warnings and redact the URLs it logs."""
        from .sources import redact_datasets_logs  # NOTE: here, as `sources` imports this module

        config = datasets.config
        config.STREAMING_READ_MAX_RETRIES = config.STREAMING_OPEN_MAX_RETRIES = self.retries
        config.STREAMING_READ_RETRY_INTERVAL = config.STREAMING_OPEN_RETRY_INTERVAL = self.wait
        config.STREAMING_READ_SERVER_UNAVAILABLE_RETRY_INTERVAL = self.wait
        redact_datasets_logs()

    def is_retried(self, error: BaseException, attempt: int, not_found_attempts: int = 1) -> bool:
        """
        Whether `attempt` (counted from 1, failures in a row) failing with `error` is tried again.

        Args:
            error (`BaseException`): what the attempt raised.
            attempt (`int`): the failed attempt's number.
            not_found_attempts (`int`, *optional*, defaults to 1): attempts for a `FileNotFoundError` that names a
                remote URL (`datasets` reports a 503 while opening a shard as one, hiding its cause); 1, where the
                cause is kept, so that a missing file fails at once.
        """
        if attempt >= self.retries:
            return False
        if is_transient_network_error(error):
            return True
        unclear = isinstance(error, FileNotFoundError) and remote_url_in_error(error) is not None
        return unclear and attempt < not_found_attempts

    def back_off(self, what: str, error: BaseException, attempt: int, how: str = "") -> None:
        """Log that `what` (e.g. `"Reading <url>"`) failed with `error` and will be tried again (`how`, e.g.
        `"reopening it at row 12"`), then wait before the next attempt."""
        retry = f"retry {attempt}/{self.retries - 1} in {self.wait:g} s" + (f", {how}" if how else "")
        logger.warning(redact_urls(f"{what} failed ({describe_error(error)}); {retry}."))
        time.sleep(self.wait)

    def call(self, function: Callable[[], Any], what: str, not_found_attempts: int = 3) -> Any:
        """
        `function()`, retried on connection errors, timeouts and 5xx answers; other errors are raised at once.

        Args:
            function (`Callable`): what to run, e.g. opening a remote dataset.
            what (`str`): what it opens, for the messages (redacted there).
            not_found_attempts (`int`, *optional*, defaults to 3): see `is_retried`.

        Raises:
            `ConnectionError`: once the attempts are spent, naming `what` and the last error. Other errors are raised
            as they are, or, when their message names a URL's credentials, as an error of their type with the
            redacted message (without the chain, which a traceback would print).
        """
        what = redact_urls(what)
        attempt = 0
        while True:
            attempt += 1
            try:
                return function()
            except Exception as error:  # noqa: BLE001 - filtered just below
                if self.is_retried(error, attempt, not_found_attempts):
                    self.back_off(f"Opening {what}", error, attempt)
                    continue
                if is_transient_network_error(error):
                    raise ConnectionError(
                        f"Opening {what} failed after {self.retries} attempts (--stream_retries), with "
                        f"{describe_error(error)}. The server or the network is down: run again once it is back, or "
                        "allow more attempts with --stream_retries and --stream_retry_wait."
                    ) from safe_cause(error)
                redacted = redact_error(error)
                if redacted is error:
                    raise
                raise redacted from None


__all__ = [
    "StreamRetries",
    "describe_error",
    "is_transient_network_error",
    "redact_error",
    "remote_url_in_error",
    "safe_cause",
]
