"""The statistics the sampled-exactness tests share."""

from __future__ import annotations

import math


def chi2_threshold(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 3.09: alpha = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
