"""One mapping from a lab's errors to an env's errors, for every env that calls a lab.

- ``LabAuthError`` passes through: a setup error stops the env (and the run), never
  scored as the model's action;
- ``LabRejectedError`` becomes ``InvalidActionError``: the lab refused what the model asked for;
- any other ``LabError`` becomes ``EnvError``: the lab failed, not the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from labrl.errors import EnvError, InvalidActionError, LabAuthError, LabError, LabRejectedError


@contextmanager
def lab_errors_as_env_errors(*, refused: str, failed: str) -> Iterator[None]:
    """Map lab errors raised in the block; ``refused`` and ``failed`` are messages formatted with
    ``exc`` (the lab error) and ``kind`` (its class name)."""
    try:
        yield
    except LabAuthError:
        raise
    except LabRejectedError as exc:
        raise InvalidActionError(refused.format(exc=exc, kind=type(exc).__name__)) from exc
    except LabError as exc:
        raise EnvError(failed.format(exc=exc, kind=type(exc).__name__)) from exc
