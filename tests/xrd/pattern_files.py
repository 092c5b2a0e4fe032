"""Writes measured-pattern files to their formats' published layouts, for the reader tests.

No PyPI package installed here ships XRDML/.xy test files (xrayutilities' wheel has no
test data; pymatgen's test files are not in its wheel), so the fixtures are generated:
the counts are a simulated measurement (``mixture.measure``) and each writer follows
its format's specification, not the reader:

- XRDML: the PANalytical XRDMeasurement schema (namespace
  http://www.xrdml.com/XRDMeasurement/1.5, element order of XRDMeasurement.xsd:
  sample, xrdMeasurement/usedWavelength(kAlpha1, kAlpha2, kBeta, ratioKAlpha2KAlpha1),
  incidentBeamPath, scan/header, scan/dataPoints(positions 2Theta + Omega,
  beamAttenuationFactors?, commonCountingTime, counts|intensities));
  ``legacy=True`` writes the 1.0 layout (``intensities``, ``listPositions``).
- .xy / .xye: whitespace columns 2θ, I[, σ] after ``#`` comment lines (GSAS-II/Fullprof
  "xye" convention); .csv: comma separated with a header row.

``python tests/xrd/pattern_files.py OUT_DIR`` writes one of each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from labrl.verifiers.xrd.mixture import Component, Sample, measure
from labrl.verifiers.xrd.profile import Instrument

XRDML_NS = "http://www.xrdml.com/XRDMeasurement/1.5"
XRDML_NS_LEGACY = "http://www.xrdml.com/XRDMeasurement/1.0"

SAMPLE = Sample(
    components=(
        Component(phase_id="NaCl_225_cF8", weight_fraction=0.6, crystallite_nm=120.0, b_iso=1.0),
        Component(phase_id="TiO2_136_tP6", weight_fraction=0.4, crystallite_nm=60.0, b_iso=0.4),
    ),
    # v1 physics: f', f'' at Cu Kα1 (identify switches them on for anode lines) and per-phase B
    instrument=Instrument(two_theta_min=15.0, two_theta_max=75.0, step=0.02, anomalous_dispersion=True),
    peak_counts=8000.0,
)


def simulated(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    m = measure(SAMPLE, seed)
    return m.two_theta, m.counts


def write_xy(path: Path, x: np.ndarray, y: np.ndarray, sigma: np.ndarray | None = None, *, wavelength=1.5406):
    lines = ["# simulated NaCl + TiO2 (rutile)", f"# Wavelength = {wavelength} A"]
    for i in range(len(x)):
        row = f"{x[i]:.4f} {y[i]:.1f}"
        if sigma is not None:
            row += f" {sigma[i]:.3f}"
        lines.append(row)
    path.write_text("\n".join(lines) + "\n")
    return path


def write_csv(path: Path, x: np.ndarray, y: np.ndarray, *, x_name: str = "2theta", y_name: str = "counts"):
    lines = [f"{x_name},{y_name}"] + [f"{a:.6f},{b:.3f}" for a, b in zip(x, y, strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_xrdml(
    path: Path,
    x: np.ndarray,
    y: np.ndarray,
    *,
    legacy: bool = False,
    counting_time: float = 1.0,
    attenuation: np.ndarray | None = None,
    ka1: float = 1.5405980,
    ka2: float = 1.5444260,
    ratio: float = 0.5,
) -> Path:
    ns = XRDML_NS_LEGACY if legacy else XRDML_NS
    data_tag = "intensities" if legacy else "counts"
    if legacy:
        positions = f"<listPositions>{' '.join(f'{v:.5f}' for v in x)}</listPositions>"
    else:
        positions = f"<startPosition>{x[0]:.5f}</startPosition><endPosition>{x[-1]:.5f}</endPosition>"
    att = ""
    if attenuation is not None:
        att = f"<beamAttenuationFactors>{' '.join(f'{v:.4f}' for v in attenuation)}</beamAttenuationFactors>"
    body = f"""<?xml version="1.0" encoding="UTF-8"?>
<xrdMeasurements xmlns="{ns}" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" xsi:schemaLocation="{ns} {ns}/XRDMeasurement.xsd" status="Completed">
  <comment><entry>Configuration=Reflection-transmission spinner</entry></comment>
  <sample type="To be analyzed">
    <id>S1</id>
    <name>NaCl-TiO2</name>
  </sample>
  <xrdMeasurement measurementType="Scan" status="Completed" sampleMode="Reflection">
    <usedWavelength intended="K-Alpha">
      <kAlpha1 unit="Angstrom">{ka1:.7f}</kAlpha1>
      <kAlpha2 unit="Angstrom">{ka2:.7f}</kAlpha2>
      <kBeta unit="Angstrom">1.3922500</kBeta>
      <ratioKAlpha2KAlpha1>{ratio:.4f}</ratioKAlpha2KAlpha1>
    </usedWavelength>
    <incidentBeamPath>
      <radius unit="mm">240.00</radius>
      <xRayTube name="Cu LFF"><tension unit="kV">45</tension><current unit="mA">40</current><anodeMaterial>Cu</anodeMaterial></xRayTube>
    </incidentBeamPath>
    <scan appendNumber="0" mode="Continuous" scanAxis="Gonio" status="Completed">
      <header>
        <startTimeStamp>2026-01-01T10:00:00+00:00</startTimeStamp>
        <endTimeStamp>2026-01-01T10:30:00+00:00</endTimeStamp>
        <author><name>labrl</name></author>
        <source><applicationSoftware version="1.0">labrl tests</applicationSoftware></source>
      </header>
      <dataPoints>
        <positions axis="2Theta" unit="deg">{positions}</positions>
        <positions axis="Omega" unit="deg"><startPosition>{x[0] / 2:.5f}</startPosition><endPosition>{x[-1] / 2:.5f}</endPosition></positions>
        {att}
        <commonCountingTime unit="seconds">{counting_time:.2f}</commonCountingTime>
        <{data_tag} unit="counts">{" ".join(f"{v:.0f}" for v in y)}</{data_tag}>
      </dataPoints>
    </scan>
  </xrdMeasurement>
</xrdMeasurements>
"""
    path.write_text(body)
    return path


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else ".")
    out.mkdir(parents=True, exist_ok=True)
    x, y = simulated()
    write_xy(out / "mixture.xy", x, y)
    write_xy(out / "mixture.xye", x, y, np.sqrt(np.maximum(y, 1.0)))
    write_csv(out / "mixture.csv", x, y)
    write_xrdml(out / "mixture.xrdml", x, y)
    write_xrdml(out / "mixture_v1_0.xrdml", x, y, legacy=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
