"""matplotlib for the report's PNGs (the speed and memory sections' plots), without a display."""

from __future__ import annotations


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on the GPU machine or in CI
    import matplotlib.pyplot as plt

    return plt
