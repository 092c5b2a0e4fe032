"""The linear part of both phase fits (``fit``, ``fit_v1``): non-negative scales over a projected-out background.

For fixed nonlinear parameters the model is linear in the phase scales S_p ≥ 0
and the Chebyshev coefficients c_k; ``LinearProblem`` solves it by weighted
least squares (w = 1 / max(y, 1)) with an active set on the S_p, and
``translated`` moves rendered columns along 2θ for the coarse zero-shift scan.
"""

from __future__ import annotations

import math

import numpy as np

COARSE_ZERO_STEP = 0.03  # degrees; below the narrowest peak width, so the linearised steps converge

# A normalised Gram matrix whose eigenvalues span more than this ratio (columns with a cosine
# above ~1 − 1e-10) is solved by SVD on the columns instead, which treats near-duplicates as
# ``np.linalg.lstsq`` does.
GRAM_MIN_RATIO = 1e-10


class LinearProblem:
    """Weighted linear least squares with non-negative phase scales and a free background.

    The background is eliminated once per measurement: with Q an orthonormal
    basis of the weighted Chebyshev columns B_w, every column and the weighted
    data are projected onto the complement of span(B_w), a ↦ a − Q(Qᵀa). By
    Frisch–Waugh–Lovell the phase coefficients (and the residual) of the
    projected problem equal those of the full one, so each solve only involves
    the P phase columns, through their P × P Gram matrix.
    """

    def __init__(self, counts: np.ndarray, basis: np.ndarray):
        self.y = counts
        self.sw = 1.0 / np.sqrt(np.maximum(counts, 1.0))  # sqrt of weights, (n,)
        self.yw = self.y * self.sw
        self.norm = float(self.yw @ self.yw)
        self.q = orthonormal(basis * self.sw[:, None])  # (n, K)
        self.y_perp = self.project(self.yw)  # (n,)

    def project(self, a: np.ndarray) -> np.ndarray:
        """Component of ``a`` ((n,), (n, m) or (T, n, m), weighted) orthogonal to the background."""
        return a - self.q @ (self.q.T @ a)

    def design(self, columns: list[np.ndarray]) -> np.ndarray:
        """Weighted, projected phase columns (n, P)."""
        if not columns:
            return np.zeros((len(self.y), 0))
        return self.project(np.column_stack(columns) * self.sw[:, None])

    def rwp(self, resid: np.ndarray) -> float:
        return float(np.sqrt(resid @ resid / self.norm))

    def solve(
        self, design: np.ndarray, gram: np.ndarray | None = None, rhs: np.ndarray | None = None
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """(Rwp, phase scales (P,), weighted residual (n,)) for a projected design (n, P).

        Active set: solve, drop the most negative scale, repeat until none is negative.
        ``gram`` = designᵀdesign and ``rhs`` = designᵀy⊥ may be passed when computed in a batch.
        """
        n_phase = design.shape[1]
        gram = design.T @ design if gram is None else gram  # (P, P)
        rhs = design.T @ self.y_perp if rhs is None else rhs  # (P,)
        active = list(range(n_phase))
        scales = np.zeros(n_phase)
        while active:
            sub = np.ix_(active, active) if len(active) < n_phase else slice(None)
            coef = normal_lstsq(gram[sub], rhs[active], design[:, active], self.y_perp)
            if coef.min() >= 0:
                scales[active] = coef
                break
            active.pop(int(np.argmin(coef)))
        resid = self.y_perp - design @ scales
        return self.rwp(resid), scales, resid

    def rwps(self, designs: np.ndarray) -> np.ndarray:
        """Rwp of ``solve`` for each projected design of a batch (T, n, P): (T,).

        The normal equations of all designs are solved at once, with
        Rwp² = (|y⊥|² − cᵀXᵀy⊥) / Σwy² at the least-squares solution c; designs whose
        solution has a negative scale (or a zero or near-singular column) go through
        ``solve``'s active set one by one.
        """
        n_batch, _, n_phase = designs.shape
        if n_phase == 0:
            return np.full(n_batch, self.rwp(self.y_perp))
        designs_t = designs.transpose(0, 2, 1)  # (T, P, n)
        grams, rhs = designs_t @ designs, designs_t @ self.y_perp  # (T, P, P), (T, P)
        diag = grams.diagonal(axis1=1, axis2=2)  # (T, P)
        inv_norm = 1.0 / np.sqrt(np.where(diag > 0, diag, 1.0))  # (T, P)
        eigval, eigvec = np.linalg.eigh(grams * inv_norm[:, :, None] * inv_norm[:, None, :])
        with np.errstate(divide="ignore", invalid="ignore"):  # singular ones are redone by ``solve``
            along = (eigvec.transpose(0, 2, 1) @ (rhs * inv_norm)[:, :, None])[:, :, 0] / eigval  # (T, P)
            coef = inv_norm * (eigvec @ along[:, :, None])[:, :, 0]  # (T, P)
            fast = (
                (diag > 0).all(axis=1)
                & (eigval[:, 0] > GRAM_MIN_RATIO * eigval[:, -1])
                & (coef.min(axis=1) >= 0)
            )
            resid2 = self.y_perp @ self.y_perp - (coef * rhs).sum(axis=1)  # (T,)
            out = np.sqrt(np.maximum(resid2, 0.0) / self.norm)
        for t in np.flatnonzero(~fast):
            out[t] = self.solve(designs[t], grams[t], rhs[t])[0]
        return out


def orthonormal(a: np.ndarray) -> np.ndarray:
    """Q (n, K) with span(Q) = span(a) and QᵀQ = I: Cholesky QR, done twice for orthogonality to ε."""
    for _ in range(2):
        chol = np.linalg.cholesky(a.T @ a)  # aᵀa = L Lᵀ, (K, K)
        a = a @ np.linalg.inv(chol).T  # a L⁻ᵀ
    return a


def normal_lstsq(gram: np.ndarray, rhs: np.ndarray, design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin_c |target − design c|² from the normal equations ``gram c = rhs`` (gram = designᵀdesign).

    Solved on the unit-diagonal Gram D G D (D = diag(G)^(−1/2)) by its eigendecomposition.
    All-zero columns get 0 (the minimum-norm choice); a near-singular rest falls back to
    ``np.linalg.lstsq`` on the columns themselves.
    """
    diag = gram.diagonal()
    if diag.min() <= 0:
        coef = np.zeros(len(rhs))
        live = diag > 0
        if live.any():
            coef[live] = normal_lstsq(gram[np.ix_(live, live)], rhs[live], design[:, live], target)
        return coef
    inv_norm = 1.0 / np.sqrt(diag)
    eigval, eigvec = np.linalg.eigh(gram * np.outer(inv_norm, inv_norm))
    if eigval[0] > GRAM_MIN_RATIO * eigval[-1]:
        return inv_norm * (eigvec @ ((eigvec.T @ (rhs * inv_norm)) / eigval))
    return np.linalg.lstsq(design, target, rcond=None)[0]


def translated(columns: np.ndarray, deltas: np.ndarray, step: float) -> np.ndarray:
    """``columns`` (n, P) sampled at 2θ − δ for each δ (T,): (T, n, P).

    Linear interpolation between grid points and 0 outside the scan: the values of
    ``np.interp(grid − δ, grid, column, left=0, right=0)`` on a uniform grid, where
    point i samples the fractional index i − δ/step.
    """
    n = columns.shape[0]
    # a zero row past the end: with rounding in −δ/step the last sample may sit a hair beyond n − 1
    padded = np.vstack([columns, np.zeros((1, columns.shape[1]))])  # (n + 1, P)
    out = np.zeros((len(deltas), *columns.shape))
    for t, delta in enumerate(deltas):
        shift = -float(delta) / step
        whole = math.floor(shift)
        frac = shift - whole
        first = max(math.ceil(-shift), 0)  # points whose sample lies inside [0, n − 1]
        last = min(math.floor(n - 1 - shift), n - 1)
        if last < first:
            continue
        src = slice(first + whole, last + whole + 1)
        out[t, first : last + 1] = (1.0 - frac) * padded[src]
        if frac:
            out[t, first : last + 1] += frac * padded[first + whole + 1 : last + whole + 2]
    return out
