"""Readers for measured powder patterns: ``.xy``, ``.xye``, ``.csv`` and PANalytical ``.xrdml``.

Every reader returns a ``MeasuredPattern``: 2θ (degrees, increasing), intensity
in counts where the file allows, σ, the wavelengths and the file's metadata.

Column files (``.xy``, ``.xye``, ``.dat``, ``.txt``, ``.csv``)
    Columns split on whitespace, ``,``, ``;`` or tabs. Lines starting with
    ``#``, ``!``, ``;``, ``'`` or ``%`` are comments; one non-numeric line
    before the data is a header naming the columns. The first column is 2θ in
    degrees unless the header names it ``q`` (Å⁻¹) or ``d`` (Å), which are
    converted with the wavelength::

        2θ = 2 asin(Q λ / 4π)        2θ = 2 asin(λ / 2d)

    The second column is the intensity (counts; ``cps``/``counts/s`` in the
    header multiplies by a counting time stated in the comments, else stays a
    rate), the third, if present, its standard deviation σ (``.xye``). Without
    σ, Poisson statistics give σ = sqrt(max(I, 1)). A comment such as
    ``# wavelength = 1.5406`` (``lambda``, ``λ``; Å, or ``nm``) sets λ.

PANalytical XRDML (schema http://www.xrdml.com/XRDMeasurement/1.x)
    ``xrdMeasurement/usedWavelength`` gives ``kAlpha1``, ``kAlpha2`` (Å) and
    ``ratioKAlpha2KAlpha1``; ``scan/dataPoints`` gives the ``positions`` of the
    ``2Theta`` axis (``startPosition``/``endPosition``, evenly spaced over the
    points, or ``listPositions``), ``commonCountingTime`` (s) and the data in
    ``counts`` or ``intensities``. Counts are multiplied by
    ``beamAttenuationFactors`` when present (σ by the same factor); a rate
    unit (``counts/s``, ``cps``) is turned back into counts with the counting
    time, so σ = sqrt(counts) holds.

Bruker ``.raw``/``.brml`` are not read: no maintained Python reader installs
here (``xylib-py`` 1.6.1 is a 2020 source-only release that needs SWIG and
Boost to build, and fails; ``xrayutilities`` 1.8 reads XRDML but no Bruker
format), and Bruker publishes no specification to write one against. Export
``.xy`` or ``.xrdml`` from the instrument software instead.

Malformed files raise ``PatternFileError`` naming the file and line.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
import xml.parsers.expat
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from labrl.errors import PatternFileError

COMMENT_PREFIXES = ("#", "!", ";", "'", "%")
COLUMN_SUFFIXES = (".xy", ".xye", ".dat", ".txt", ".csv")
_SPLIT = re.compile(r"[\s,;]+")
_WAVELENGTH = re.compile(
    r"(?:wavelength|lambda|λ|kalpha1|k-alpha1|ka1)\s*(?:\(?\s*(å|a|angstrom|nm)\s*\)?)?\s*[:=]?\s*"
    r"([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*(å|a|angstrom|angstroms|nm)?",
    re.IGNORECASE,
)
_COUNT_TIME = re.compile(
    r"(?:counting[ _]time|count[ _]time|time per step|step time)\s*(?:\(s\))?\s*[:=]?\s*([0-9]*\.?[0-9]+)",
    re.IGNORECASE,
)
_UNIFORM_TOL = 1e-3  # relative spread of the steps below which a scan counts as evenly spaced


@dataclass(frozen=True)
class MeasuredPattern:
    """A measured powder pattern (arrays (n,), 2θ increasing, in degrees)."""

    two_theta: np.ndarray
    intensity: np.ndarray
    sigma: np.ndarray
    wavelength: float | None = None  # Kα1 (or the only wavelength), Å
    wavelength_ka2: float | None = None  # Å
    ka2_ratio: float | None = None  # I(Kα2) / I(Kα1)
    counting_time: float | None = None  # seconds per step
    intensity_unit: str = "counts"  # "counts" or "counts/s" (a rate the file gave no time for)
    source: dict[str, Any] = field(default_factory=dict)  # path, format and what the file says

    def __post_init__(self) -> None:
        n = len(self.two_theta)
        if len(self.intensity) != n or len(self.sigma) != n:
            raise ValueError("two_theta, intensity and sigma must have the same length")

    @property
    def step(self) -> float:
        """Median 2θ step (degrees)."""
        return float(np.median(np.diff(self.two_theta)))

    @property
    def is_uniform(self) -> bool:
        steps = np.diff(self.two_theta)
        return bool(np.ptp(steps) <= _UNIFORM_TOL * abs(float(np.median(steps))))

    def uniform(self) -> MeasuredPattern:
        """This pattern on an evenly spaced grid with its median step (linear interpolation)."""
        if self.is_uniform:
            return self
        step = self.step
        n = math.floor((self.two_theta[-1] - self.two_theta[0]) / step + 1e-9) + 1
        grid = self.two_theta[0] + step * np.arange(n)
        return replace(
            self,
            two_theta=grid,
            intensity=np.interp(grid, self.two_theta, self.intensity),
            sigma=np.interp(grid, self.two_theta, self.sigma),
            source={**self.source, "resampled_step": step},
        )

    def crop(self, lo: float, hi: float) -> MeasuredPattern:
        keep = (self.two_theta >= lo) & (self.two_theta <= hi)
        return replace(
            self, two_theta=self.two_theta[keep], intensity=self.intensity[keep], sigma=self.sigma[keep]
        )


def read_pattern(path: str | Path, *, wavelength: float | None = None) -> MeasuredPattern:
    """Read ``path`` by its suffix. ``wavelength`` (Å) is used where the file states none
    (and to convert Q or d columns); a file that states one keeps its own."""
    path = Path(path)
    if not path.is_file():
        raise PatternFileError(str(path), None, "no such file")
    suffix = path.suffix.lower()
    if suffix == ".xrdml":
        pattern = read_xrdml(path)
    elif suffix in COLUMN_SUFFIXES:
        pattern = read_columns(path, wavelength=wavelength)
    elif suffix in (".raw", ".brml"):
        raise PatternFileError(
            str(path),
            None,
            "Bruker .raw/.brml is not supported (no maintained Python reader installs cleanly); "
            "export .xy or .xrdml from the instrument software",
        )
    else:
        raise PatternFileError(
            str(path), None, f"unknown pattern format {suffix!r}: use .xy, .xye, .csv or .xrdml"
        )
    # which λ the file stated decides the beam (``radiation.beam_hypotheses``), so it is recorded
    source = {"wavelength_from_file": pattern.wavelength is not None, **pattern.source}
    if pattern.wavelength is None and wavelength is not None:
        return replace(pattern, wavelength=float(wavelength), source=source)
    return replace(pattern, source=source)


# ---------------------------------------------------------------- column files


def _wavelength_from(text: str) -> float | None:
    match = _WAVELENGTH.search(text)
    if not match:
        return None
    value = float(match.group(2))
    unit = (match.group(3) or match.group(1) or "").lower()
    return value * 10.0 if unit == "nm" else value


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _x_kind(name: str) -> str:
    """'2theta', 'q' or 'd' from a header column name."""
    key = re.sub(r"[^a-z0-9θ]", "", name.lower())
    if key in ("q", "qa1", "qinvangstrom", "qa") or key.startswith("q"):
        return "q"
    if key in ("d", "da", "dspacing", "dangstrom") or key.startswith("dspac"):
        return "d"
    return "2theta"


def read_columns(path: str | Path, *, wavelength: float | None = None) -> MeasuredPattern:
    """Read a ``.xy``/``.xye``/``.csv`` column file (see the module docstring)."""
    path = Path(path)
    name = str(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as exc:
        raise PatternFileError(name, None, f"not a text file ({exc.reason})") from None
    comments: list[str] = []
    header: list[str] | None = None
    rows: list[list[float]] = []
    width = 0
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith(COMMENT_PREFIXES):
            comments.append(line.lstrip("".join(COMMENT_PREFIXES)).strip())
            continue
        tokens = [t for t in _SPLIT.split(line) if t]
        if not all(_is_number(t) for t in tokens):
            if rows:
                raise PatternFileError(name, lineno, f"non-numeric data line {raw.strip()[:60]!r}")
            if header is not None:
                comments.append(" ".join(header))  # a title line before the header
            header = [t.strip().strip('"') for t in re.split(r"[,;\t]+|\s{2,}|\s", line) if t.strip()]
            continue
        values = [float(t) for t in tokens]
        if not width:
            if len(values) < 2:
                raise PatternFileError(name, lineno, "need at least two columns (2θ, intensity)")
            width = min(len(values), 3)
        elif len(values) < width:
            raise PatternFileError(name, lineno, f"expected {width} columns, found {len(values)}")
        if not all(math.isfinite(v) for v in values[:width]):
            raise PatternFileError(name, lineno, "non-finite value")
        if width == 3 and values[2] <= 0:
            raise PatternFileError(name, lineno, f"standard deviation must be positive, got {values[2]}")
        rows.append(values[:width])
        rows[-1].append(lineno)
    if len(rows) < 2:
        raise PatternFileError(name, None, "fewer than two data points")
    data = np.asarray(rows)
    x, intensity, line_of = data[:, 0], data[:, 1], data[:, -1].astype(int)
    sigma = data[:, 2] if width == 3 else None
    meta_text = "\n".join(comments + ([" ".join(header)] if header else []))
    file_wavelength = _wavelength_from(meta_text)
    lam = file_wavelength if file_wavelength is not None else wavelength
    kind = _x_kind(header[0]) if header else "2theta"
    if kind != "2theta":
        if lam is None:
            raise PatternFileError(name, None, f"the x column is {kind}: give the wavelength to convert it")
        x = _to_two_theta(x, kind, lam, name, line_of)
    unit = "counts"
    counting_time = None
    time_match = _COUNT_TIME.search(meta_text)
    if time_match:
        counting_time = float(time_match.group(1))
    if header and len(header) > 1 and re.search(r"cps|counts?/s|/sec|per second", header[1], re.IGNORECASE):
        if counting_time:
            intensity = intensity * counting_time
            sigma = None if sigma is None else sigma * counting_time
        else:
            unit = "counts/s"
    x, intensity, sigma = _increasing(x, intensity, sigma, name, line_of)
    if sigma is None:
        sigma = np.sqrt(np.maximum(intensity, 1.0))
    return MeasuredPattern(
        two_theta=x,
        intensity=intensity,
        sigma=sigma,
        wavelength=lam,
        counting_time=counting_time,
        intensity_unit=unit,
        source={
            "path": name,
            "format": "xye" if width == 3 else "xy",
            "x_column": kind,
            "header": header,
            "wavelength_from_file": file_wavelength is not None,
        },
    )


def _to_two_theta(x: np.ndarray, kind: str, lam: float, name: str, line_of: np.ndarray) -> np.ndarray:
    sin = x * lam / (4.0 * math.pi) if kind == "q" else lam / (2.0 * np.where(x > 0, x, np.nan))
    bad = ~((sin > 0) & (sin < 1))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PatternFileError(name, int(line_of[i]), f"{kind} = {x[i]} has no Bragg angle at λ = {lam} Å")
    return np.degrees(2.0 * np.arcsin(sin))


def _increasing(
    x: np.ndarray, intensity: np.ndarray, sigma: np.ndarray | None, name: str, line_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Arrays ordered by increasing 2θ: a strictly decreasing scan is reversed; anything else must increase."""
    steps = np.diff(x)
    if (steps < 0).all():
        order = slice(None, None, -1)
        return x[order], intensity[order], None if sigma is None else sigma[order]
    bad = np.flatnonzero(steps <= 0)
    if bad.size:
        i = int(bad[0]) + 1
        raise PatternFileError(name, int(line_of[i]), f"2θ does not increase ({x[i - 1]} then {x[i]})")
    return x, intensity, sigma


# ---------------------------------------------------------------- XRDML


Fail = Callable[[ET.Element | None, str], PatternFileError]


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _child(elem: ET.Element, name: str) -> ET.Element | None:
    for c in elem:
        if _local(c.tag) == name:
            return c
    return None


def _children(elem: ET.Element, name: str) -> list[ET.Element]:
    return [c for c in elem if _local(c.tag) == name]


def _floats(elem: ET.Element, fail: Fail, what: str) -> np.ndarray:
    try:
        values = np.array([float(t) for t in (elem.text or "").split()])
    except ValueError as exc:
        raise fail(elem, f"<{what}> holds a non-number ({exc})") from None
    if not np.isfinite(values).all():
        raise fail(elem, f"<{what}> holds a non-finite value")
    return values


def _scalar(elem: ET.Element | None, fail: Fail, what: str) -> float | None:
    if elem is None or elem.text is None or not elem.text.strip():
        return None
    try:
        return float(elem.text)
    except ValueError:
        raise fail(elem, f"<{what}> is not a number: {elem.text.strip()!r}") from None


def _angstrom(elem: ET.Element | None, fail: Fail, what: str) -> float | None:
    value = _scalar(elem, fail, what)
    if value is None or elem is None:
        return None
    unit = (elem.get("unit") or "Angstrom").lower()
    if unit in ("angstrom", "å", "a"):
        return value
    if unit == "nm":
        return value * 10.0
    raise fail(elem, f"<{what}> has unit {unit!r}; expected Angstrom")


def _parse_xml(path: Path) -> tuple[ET.Element, dict[int, int]]:
    """The element tree of ``path`` and the line (1-based) each element starts on, by ``id``."""
    builder = ET.TreeBuilder()
    lines: dict[int, int] = {}
    parser = xml.parsers.expat.ParserCreate(namespace_separator="}")

    def start(tag: str, attrs: dict[str, str]) -> None:
        # expat gives "uri}local" (no opening brace); ElementTree spells it "{uri}local"
        clean = {(f"{{{k}" if "}" in k else k): v for k, v in attrs.items()}
        elem = builder.start(f"{{{tag}" if "}" in tag else tag, clean)
        lines[id(elem)] = parser.CurrentLineNumber

    parser.StartElementHandler = start
    parser.EndElementHandler = lambda tag: builder.end(f"{{{tag}" if "}" in tag else tag)
    parser.CharacterDataHandler = builder.data
    try:
        with path.open("rb") as handle:
            parser.ParseFile(handle)
        root = builder.close()
    except xml.parsers.expat.ExpatError as exc:
        raise PatternFileError(str(path), exc.lineno, f"not well-formed XML: {exc}") from None
    except AssertionError:  # TreeBuilder.close on a document without a root
        raise PatternFileError(str(path), None, "empty XML document") from None
    return root, lines


def read_xrdml(path: str | Path, *, scan: int = 0) -> MeasuredPattern:
    """Read scan ``scan`` of a PANalytical XRDML file (see the module docstring)."""
    path = Path(path)
    name = str(path)
    root, lines = _parse_xml(path)

    def fail(elem: ET.Element | None, reason: str) -> PatternFileError:
        return PatternFileError(name, lines.get(id(elem)) if elem is not None else None, reason)

    if _local(root.tag) != "xrdMeasurements":
        raise fail(root, f"root element is <{_local(root.tag)}>, expected <xrdMeasurements>")
    namespace = root.tag[1:].split("}", 1)[0] if root.tag.startswith("{") else ""
    measurement = _child(root, "xrdMeasurement")
    if measurement is None:
        raise fail(root, "no <xrdMeasurement> element")
    wl = _child(measurement, "usedWavelength")
    ka1 = ka2 = ratio = None
    if wl is not None:
        ka1 = _angstrom(_child(wl, "kAlpha1"), fail, "kAlpha1")
        ka2 = _angstrom(_child(wl, "kAlpha2"), fail, "kAlpha2")
        ratio = _scalar(_child(wl, "ratioKAlpha2KAlpha1"), fail, "ratioKAlpha2KAlpha1")
    scans = _children(measurement, "scan")
    if not scans:
        raise fail(measurement, "no <scan> element")
    if not 0 <= scan < len(scans):
        raise fail(measurement, f"scan {scan} requested, the file has {len(scans)}")
    points = _child(scans[scan], "dataPoints")
    if points is None:
        raise fail(scans[scan], "the scan has no <dataPoints>")
    data_elem = _child(points, "counts")
    what = "counts"
    if data_elem is None:
        data_elem, what = _child(points, "intensities"), "intensities"
    if data_elem is None:
        raise fail(points, "<dataPoints> has neither <counts> nor <intensities>")
    values = _floats(data_elem, fail, what)
    n = len(values)
    if n < 2:
        raise fail(data_elem, f"<{what}> holds {n} value(s); need at least two")
    two_theta = _two_theta_positions(points, n, fail)
    counting_time = _scalar(_child(points, "commonCountingTime"), fail, "commonCountingTime")
    times = _child(points, "countingTimes")
    time_per_point = _floats(times, fail, "countingTimes") if times is not None else None
    if time_per_point is not None and len(time_per_point) != n:
        raise fail(times, f"<countingTimes> has {len(time_per_point)} values for {n} points")
    unit = (data_elem.get("unit") or "counts").lower()
    intensity_unit = "counts"
    if unit in ("counts/s", "cps", "counts per second", "counts/sec"):
        seconds = time_per_point if time_per_point is not None else counting_time
        if seconds is None:
            intensity_unit = "counts/s"
        else:
            values = values * seconds
    elif unit != "counts":
        raise fail(data_elem, f"<{what}> has unit {unit!r}; expected counts or counts/s")
    sigma = np.sqrt(np.maximum(values, 1.0))
    attenuation = _child(points, "beamAttenuationFactors")
    if attenuation is not None:
        factors = _floats(attenuation, fail, "beamAttenuationFactors")
        if len(factors) != n:
            raise fail(attenuation, f"<beamAttenuationFactors> has {len(factors)} values for {n} points")
        values, sigma = values * factors, sigma * factors
    if np.any(values < 0):
        raise fail(data_elem, f"<{what}> holds negative counts")
    steps = np.diff(two_theta)
    if (steps < 0).all():
        two_theta, values, sigma = two_theta[::-1], values[::-1], sigma[::-1]
    elif (steps <= 0).any():
        raise fail(points, "2Theta positions do not increase")
    sample = _child(root, "sample")
    return MeasuredPattern(
        two_theta=two_theta,
        intensity=values,
        sigma=sigma,
        wavelength=ka1,
        wavelength_ka2=ka2,
        ka2_ratio=ratio,
        counting_time=counting_time,
        intensity_unit=intensity_unit,
        source={
            "path": name,
            "format": "xrdml",
            "namespace": namespace,
            "scans": len(scans),
            "scan": scan,
            "intended_wavelength": wl.get("intended") if wl is not None else None,
            "sample": (
                _child(sample, "name").text
                if sample is not None and _child(sample, "name") is not None
                else None
            ),
        },
    )


def _two_theta_positions(points: ET.Element, n: int, fail: Fail) -> np.ndarray:
    for pos in _children(points, "positions"):
        if pos.get("axis") != "2Theta":
            continue
        unit = (pos.get("unit") or "deg").lower()
        if unit not in ("deg", "degree", "degrees"):
            raise fail(pos, f"2Theta positions have unit {unit!r}; expected deg")
        listed = _child(pos, "listPositions")
        if listed is not None:
            values = _floats(listed, fail, "listPositions")
            if len(values) != n:
                raise fail(listed, f"<listPositions> has {len(values)} values for {n} points")
            return values
        start = _scalar(_child(pos, "startPosition"), fail, "startPosition")
        end = _scalar(_child(pos, "endPosition"), fail, "endPosition")
        if start is None or end is None:
            raise fail(pos, "2Theta <positions> need startPosition and endPosition")
        if start == end:
            raise fail(pos, "2Theta startPosition equals endPosition")
        return np.linspace(start, end, n)
    raise fail(points, 'no <positions axis="2Theta"> in <dataPoints>')
