"""Shared pieces of the simulator envs: prototypes, the calculator client, answer parsing.

Every calculation goes through a ``LabAdapter``: the local
``SimulatorAdapter`` (EMT / CHGNet in the process pool, PySCF in a killable
subprocess, results cached by canonical structure hash) or, with
``backend="remote"``, a ``RestLabAdapter`` to a lab whose ``calculation``
jobs run the ``remote_backend`` calculator. Adapters are shared per process
and event loop, so the cache serves every episode.
"""

from __future__ import annotations

import asyncio
import math
import re
import weakref
from typing import Any

import numpy as np
from ase import Atoms

from labrl.envs.lab_errors import lab_errors_as_env_errors
from labrl.errors import ConfigError, EnvError, InvalidActionError, LabError
from labrl.lab_adapters.calculators import check_backend
from labrl.lab_adapters.protocol import JobState, LabAdapter
from labrl.lab_adapters.simulator import SimulatorAdapter
from labrl.untrusted_text import last_block

#: cubic prototypes: name -> (fractional sites, number of distinct species)
PROTOTYPES: dict[str, tuple[tuple[tuple[float, float, float], ...], int]] = {
    "fcc": (((0, 0, 0), (0.5, 0.5, 0), (0.5, 0, 0.5), (0, 0.5, 0.5)), 1),
    "bcc": (((0, 0, 0), (0.5, 0.5, 0.5)), 1),
    "sc": (((0, 0, 0),), 1),
    "L1_2": (((0, 0, 0), (0.5, 0.5, 0), (0.5, 0, 0.5), (0, 0.5, 0.5)), 2),  # A3B: B at the corner
    "B2": (((0, 0, 0), (0.5, 0.5, 0.5)), 2),  # AB, CsCl type
}


def prototype_atoms(prototype: str, elements: tuple[str, ...], a: float) -> Atoms:
    """A cubic cell of ``prototype`` with lattice constant ``a`` (Å)."""
    sites, _ = PROTOTYPES[prototype]
    if prototype == "L1_2":
        species = [elements[1], elements[0], elements[0], elements[0]]
    elif prototype == "B2":
        species = [elements[0], elements[1]]
    else:
        species = [elements[0]] * len(sites)
    return Atoms(species, scaled_positions=np.array(sites, dtype=float), cell=np.eye(3) * a, pbc=True)


def formula_of(prototype: str, elements: tuple[str, ...]) -> str:
    if prototype == "L1_2":
        return f"{elements[0]}3{elements[1]}"
    if prototype == "B2":
        return f"{elements[0]}{elements[1]}"
    return elements[0]


_ADAPTERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[Any, ...], LabAdapter]] = (
    weakref.WeakKeyDictionary()
)


def shared_adapter(backend: str, lab_url: str | None, api_key_env: str, timeout_s: float) -> LabAdapter:
    """The process-wide adapter for this backend on the running loop."""
    loop = asyncio.get_running_loop()
    adapters = _ADAPTERS.setdefault(loop, {})
    key = (backend, lab_url, api_key_env, timeout_s)
    if key not in adapters:
        if backend == "remote":
            from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig

            adapters[key] = RestLabAdapter(RestLabConfig(base_url=str(lab_url), api_key_env=api_key_env))
        else:
            adapters[key] = SimulatorAdapter(timeout_s=timeout_s)
    return adapters[key]


class Calculator:
    """An env's view of its calculator: ``await calc.run(task, structure, **params)`` -> result dict."""

    def __init__(
        self,
        backend: str,
        *,
        remote_backend: str = "emt",
        lab_url: str | None = None,
        api_key_env: str = "LABRL_LAB_API_KEY",
        timeout_s: float = 600.0,
    ) -> None:
        if backend == "remote" and not lab_url:
            raise ConfigError('backend="remote" needs lab_url (the lab that runs the calculation jobs)')
        self.backend = backend
        self.calc_backend = remote_backend if backend == "remote" else backend
        self.lab_url = lab_url
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s

    def check(self, elements: set[str], tasks: set[str]) -> None:
        """``ConfigError`` now, at task creation, if the backend cannot treat ``elements``."""
        if self.backend == "remote":
            from labrl.lab_adapters.calculators import BACKENDS

            if self.calc_backend not in BACKENDS:
                raise ConfigError(f"unknown remote calculator backend {self.calc_backend!r}")
            unsupported = sorted(elements - BACKENDS[self.calc_backend].elements)
            if unsupported:
                raise ConfigError(
                    f"calculator backend {self.calc_backend!r} does not support element(s) {', '.join(unsupported)}"
                )
        else:
            check_backend(self.backend, elements, tasks)

    async def run(self, task: str, structure: dict[str, Any], **params: Any) -> dict[str, Any]:
        request = {
            "kind": "calculation",
            "backend": self.calc_backend,
            "task": task,
            "structure": structure,
            **params,
        }
        adapter = shared_adapter(self.backend, self.lab_url, self.api_key_env, self.timeout_s)
        if isinstance(adapter, SimulatorAdapter):
            try:
                return await adapter.calculate(request)
            except InvalidActionError:
                raise
            except LabError as exc:
                raise EnvError(f"calculator failed: {exc}") from exc
        from labrl.lab_adapters.protocol import request_hash

        with lab_errors_as_env_errors(
            refused="the lab refused the calculation: {exc}", failed="remote calculator failed: {exc}"
        ):
            job = await adapter.submit(request, idempotency_key=f"calc-{request_hash(request)}")
            status = await adapter.wait(job, self.timeout_s)
        if status.state is not JobState.COMPLETED or status.result is None:
            raise EnvError(f"remote calculation ended {status.state.value}: {status.error}")
        return status.result


def extract_answer(text: str) -> str:
    """The body of the last ``<answer>...</answer>`` block; ``InvalidActionError`` if there is none.

    Linear in ``len(text)`` (``labrl.untrusted_text.last_block``), also for an
    ``<answer>`` left open.
    """
    found = last_block(text, "<answer>", "</answer>")
    if found is None:
        raise InvalidActionError("no <answer>...</answer> block found")
    return found.strip()


#: one number, optionally followed by a unit of Å
_ANGSTROM_NUMBER = re.compile(
    r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(?:Å|A|angstroms?|Angstroms?)?\s*$"
)


def parse_angstrom(body: str, what: str = "the lattice constant") -> float:
    """A positive finite length in Å from an answer's body (``4.03``, ``4.03 Å``); else
    ``InvalidActionError`` naming ``what``."""
    match = _ANGSTROM_NUMBER.match(body)
    if not match:
        raise InvalidActionError(f"the answer must be one number in Å, got {body[:60]!r}")
    value = float(match.group(1))
    if not math.isfinite(value) or value <= 0:
        raise InvalidActionError(f"{what} must be a positive finite number, got {value}")
    return value


def split_of(task_id: str) -> str:
    """Deterministic train/test assignment: 1 in 4 task ids (by a stable hash) is test."""
    import hashlib

    return "test" if int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16) % 4 == 0 else "train"
