"""Anomalous dispersion f′, f″ at the characteristic lines of the common X-ray anodes.

Near an absorption edge an atom's scattering factor gains a wavelength-dependent
complex correction::

    f(s, λ) = f₀(s) + f′(λ) + i f″(λ)

f′ and f″ are, to a very good approximation, independent of s (they come from
the tightly bound core electrons). The shipped table ``data/anomalous.json``
holds f′ and f″ for every element of the scattering table at the Kα1 and Kα2
energies (E = hc/λ, hc = 12398.4198 eV Å) of Cr, Fe, Co, Cu, Mo and Ag tubes,
taken from C. T. Chantler, J. Phys. Chem. Ref. Data 24, 71 (1995) and 29, 597
(2000) (NIST FFAST), as tabulated in the ``xraydb`` package (M. Newville,
``xraydb.f1_chantler`` / ``f2_chantler``). It is written once by
``python -m labrl.verifiers.xrd.anomalous`` (needs ``pip install xraydb``);
at run time only the JSON is read.

Line wavelengths (Å) are those of International Tables for Crystallography
Vol. C, Table 4.2.2.1, the values pymatgen's ``WAVELENGTHS`` uses.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path

import numpy as np

from labrl.errors import ConfigError

ANOMALOUS_PATH = Path(__file__).with_name("data") / "anomalous.json"
HC_EV_ANGSTROM = 12398.4198

#: (Kα1, Kα2) wavelengths in Å per anode (ITC Vol. C Table 4.2.2.1, as in pymatgen)
ANODE_LINES: dict[str, tuple[float, float]] = {
    "Cr": (2.28970, 2.29361),
    "Fe": (1.93604, 1.93998),
    "Co": (1.78896, 1.79285),
    "Cu": (1.54056, 1.54439),
    "Mo": (0.70930, 0.71359),
    "Ag": (0.559421, 0.563813),
}
#: how close (Å) a wavelength must be to a tabulated line to use its f′, f″
LINE_TOLERANCE = 2e-3


def _line_names() -> dict[str, float]:
    return {f"{anode}Ka{i + 1}": lam for anode, lines in ANODE_LINES.items() for i, lam in enumerate(lines)}


@cache
def _table() -> dict[str, dict[str, tuple[float, float]]]:
    if not ANOMALOUS_PATH.exists():
        raise ConfigError(f"{ANOMALOUS_PATH} is missing: run `python -m labrl.verifiers.xrd.anomalous`")
    return json.loads(ANOMALOUS_PATH.read_text())["lines"]


def line_for(wavelength: float) -> str:
    """The tabulated line (e.g. ``"CuKa1"``) nearest ``wavelength``; ConfigError if none is within tolerance."""
    name, lam = min(_line_names().items(), key=lambda kv: abs(kv[1] - wavelength))
    if abs(lam - wavelength) > LINE_TOLERANCE:
        raise ConfigError(
            f"no anomalous-dispersion table for λ = {wavelength} Å: tabulated lines are "
            + ", ".join(f"{k} {v}" for k, v in _line_names().items())
        )
    return name


def dispersion(elements: list[str] | tuple[str, ...], wavelength: float) -> np.ndarray:
    """Complex f′ + i f″ per element (E,) at the tabulated line nearest ``wavelength``."""
    line = _table()[line_for(wavelength)]
    missing = [el for el in elements if el not in line]
    if missing:
        raise ConfigError(f"no anomalous-dispersion values for {missing}")
    return np.array([complex(*line[el]) for el in elements])


def build_table() -> dict:
    """f′, f″ for every element of the scattering table at every line (needs ``xraydb``)."""
    import xraydb

    from labrl.verifiers.xrd.scattering import scattering_table

    elements = sorted(scattering_table().z, key=lambda el: scattering_table().z[el])
    lines = {}
    for name, lam in _line_names().items():
        energy = HC_EV_ANGSTROM / lam
        lines[name] = {
            el: (
                round(float(xraydb.f1_chantler(el, energy)), 5),
                round(float(xraydb.f2_chantler(el, energy)), 5),
            )
            for el in elements
            if scattering_table().z[el] <= 92
        }
    return {
        "source": "C. T. Chantler, J. Phys. Chem. Ref. Data 24, 71 (1995); 29, 597 (2000) (NIST FFAST), "
        f"via xraydb {xraydb.__version__} f1_chantler/f2_chantler",
        "wavelengths": _line_names(),
        "lines": lines,
    }


def main() -> int:
    text = json.dumps(build_table(), sort_keys=True, indent=0)
    ANOMALOUS_PATH.write_text(text)
    print(f"wrote {ANOMALOUS_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
