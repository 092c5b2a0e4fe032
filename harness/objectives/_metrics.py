"""The objective's metrics on the device: gathered into one vector in a few launches, read in one copy.

Every metric of ``prepare`` and ``policy_loss`` is a value already reduced (a loss) or a fraction

    m = sum_{b,t} mask_{b,t} * x_{b,t} / over        (x a flag or a value; over a count of tokens or rows)

Computing each one alone costs its own mask, sum, cast and division: four to six kernel launches a
metric, ~25 a micro-batch, which on a launch-bound GPU step cost as much as the work they describe.
``MetricSums`` stacks the flags and the values of one mask and reduces each stack in one pass:
about ten launches however many metrics, and the result, ``DeviceMetrics``, is one float64 vector,
so summing micro-batches is one add each and reading a step's metrics one host copy.

Fractions keep float64 from the sum on (``sum(..., dtype=float64)``): a count of 10^5 tokens keeps
its last digits, as the host's float division did.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

Metrics = dict[str, float | torch.Tensor]
"""Metric values as computed: 0-d device tensors stay on the device until ``host_metrics`` reads them all."""


def frac(count: torch.Tensor | int, total: torch.Tensor | int) -> float | torch.Tensor:
    """``count / total`` (0 where ``total`` is 0), a 0-d tensor on ``count``'s device when either is a tensor:
    no host copy here (``host_metrics`` reads every metric of a step at once)."""
    # float64, as the host's float division was: a fraction of 10^5 tokens keeps its last digits
    if isinstance(total, torch.Tensor):  # count <= total wherever it is used: 0 / 1 where both are 0
        return count / total.clamp(min=1).double()
    if not total:
        return 0.0
    return count.double() / total if isinstance(count, torch.Tensor) else count / total


class DeviceMetrics(Mapping[str, torch.Tensor]):
    """Named metrics held as one 1-D float64 tensor: ``self[names[i]]`` is ``vector[i]`` (a view).

    Additive like the metrics it holds: ``a + b`` of the same names is one add on the device."""

    __slots__ = ("names", "vector")

    def __init__(self, names: tuple[str, ...], vector: torch.Tensor) -> None:
        if vector.shape != (len(names),):
            raise ValueError(f"{len(names)} names for values of shape {tuple(vector.shape)}")
        if len(set(names)) != len(names):
            raise ValueError(f"metric names repeat: {names}")
        self.names = names
        self.vector = vector

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.vector[self.names.index(name)]
        except ValueError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __add__(self, other: DeviceMetrics) -> DeviceMetrics:
        if other.names != self.names:
            raise ValueError(f"cannot add metrics {other.names} to {self.names}")
        return DeviceMetrics(self.names, self.vector + other.vector)

    def to_host(self) -> dict[str, float]:
        return dict(zip(self.names, self.vector.tolist(), strict=True))


class MetricSums:
    """A batch's (or micro-batch's) metrics over one (B, T) ``mask``, built into one ``DeviceMetrics``.

    ``value`` takes a metric already reduced (0-d), ``values`` several (1-D, one name each); ``count``
    the fraction of ``mask``'s tokens whose flag is set, over ``over``; ``mean`` the sum of a
    per-token value on ``mask``'s tokens, over ``over``. ``build`` reduces every count in one pass
    and every mean in another."""

    def __init__(self, mask_B_T: torch.Tensor) -> None:
        self.mask = mask_B_T
        self._values: list[tuple[tuple[str, ...], torch.Tensor]] = []
        self._counts: list[tuple[str, torch.Tensor, int]] = []
        self._means: list[tuple[str, torch.Tensor, int]] = []

    def value(self, name: str, value: torch.Tensor) -> None:
        self._values.append(((name,), value.detach().reshape(1)))

    def values(self, names: tuple[str, ...], values: torch.Tensor) -> None:
        if values.shape != (len(names),):
            raise ValueError(f"{len(names)} names for values of shape {tuple(values.shape)}")
        self._values.append((names, values.detach()))

    def count(self, name: str, flags_B_T: torch.Tensor, over: int) -> None:
        self._counts.append((name, flags_B_T, over))

    def mean(self, name: str, values_B_T: torch.Tensor, over: int) -> None:
        self._means.append((name, values_B_T.detach(), over))

    def build(self) -> DeviceMetrics:
        parts: list[torch.Tensor] = []
        if self._values:
            values = [v for _, v in self._values]
            parts.append((torch.cat(values) if len(values) > 1 else values[0]).double())
        reduced: list[torch.Tensor] = []
        if self._counts:
            flags = torch.stack([f for _, f, _ in self._counts]) & self.mask
            reduced.append(flags.sum(dim=(1, 2), dtype=torch.float64))
        if self._means:
            # `where`, not a product: off the mask a value may be inf or nan
            masked = torch.where(self.mask, torch.stack([v for _, v, _ in self._means]), 0.0)
            reduced.append(masked.sum(dim=(1, 2), dtype=torch.float64))
        if reduced:
            overs = [over for _, _, over in self._counts + self._means]
            sums = torch.cat(reduced) if len(reduced) > 1 else reduced[0]
            # `==`, not a set: under torch.compile a count is a symbol, and hashing one would fix its value
            if all(over == overs[0] for over in overs[1:]):
                parts.append(sums / max(overs[0], 1))
            else:
                divisors = [max(over, 1) for over in overs]
                parts.append(sums / torch.tensor(divisors, dtype=torch.float64, device=sums.device))
        names = tuple(name for group, _ in self._values for name in group)
        names += tuple(name for name, *_ in self._counts + self._means)
        if not parts:
            return DeviceMetrics(names, torch.zeros(0, dtype=torch.float64, device=self.mask.device))
        return DeviceMetrics(names, torch.cat(parts) if len(parts) > 1 else parts[0])


def host_metrics(metrics: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """Every metric as a float, the tensors read in one host copy (one device sync, not one per metric)."""
    if isinstance(metrics, DeviceMetrics):
        return metrics.to_host()
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        values = torch.stack([metrics[k].detach().double().reshape(()) for k in keys]).tolist()  # type: ignore[union-attr]
        out |= dict(zip(keys, values, strict=True))
    return {k: out[k] for k in metrics}


def sum_metrics(
    micro_metrics: Iterable[Mapping[str, float | torch.Tensor]],
) -> DeviceMetrics | Metrics:
    """The sum over micro-batches of additive metrics, per name, left where they are (one add per
    micro-batch for ``DeviceMetrics`` of the same names)."""
    summed: DeviceMetrics | Metrics | None = None
    for m in micro_metrics:
        if summed is None:
            summed = m if isinstance(m, DeviceMetrics) else dict(m.items())
        elif isinstance(summed, DeviceMetrics) and isinstance(m, DeviceMetrics) and m.names == summed.names:
            summed = summed + m
        else:
            plain: Metrics = dict(summed.items()) if isinstance(summed, DeviceMetrics) else summed
            for k, v in m.items():
                plain[k] = plain[k] + v if k in plain else v
            summed = plain
    return {} if summed is None else summed
