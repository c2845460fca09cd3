"""Non-negative least squares, for fitting step costs (``StepCost.fit``, calibration)."""

from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (scipy's solver when installed, else Lawson-Hanson)."""
    try:
        from scipy.optimize import nnls
    except ImportError:
        return _lawson_hanson(a, b)
    return nnls(a, b)[0]


def _lawson_hanson(a: np.ndarray, b: np.ndarray, max_iter: int = 500) -> np.ndarray:
    num_vars = a.shape[1]
    x = np.zeros(num_vars)
    passive = np.zeros(num_vars, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0)) * float(np.abs(b).max(initial=0.0)))
    for _ in range(max_iter):
        grad = a.T @ (b - a @ x)
        candidates = ~passive & (grad > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, grad, -np.inf))] = True
        while True:
            z = np.zeros(num_vars)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return np.maximum(x, 0.0)
