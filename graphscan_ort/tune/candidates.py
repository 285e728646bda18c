"""The quantizer settings tune will try, calibrated once and reproducible.

A candidate is the keyword arguments of one ``quantize_static`` call, kept as
JSON (enums by name), so that a user can re-run exactly that call on the
prepared model with the same calibration data and get the same model.
Calibration runs once per prepared model and calibration method: the ranges
go into onnxruntime's own calibration cache (``calibration_cache_path``) and
every candidate of that method reuses them. Neither the activation type nor
per-channel weights change the ranges, so the cache is exact for all of them.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static

from graphscan_ort.shared.sessions import quiet

# The axes of the search: activation type, per-channel weights, calibration method.
ACTIVATION_TYPES = ["QUInt8", "QInt8"]


PER_CHANNEL = [False, True]


METHODS = ["MinMax", "Percentile"]


ENUMS = {"activation_type": QuantType, "weight_type": QuantType, "calibrate_method": CalibrationMethod}


def candidate_settings() -> list[dict]:
    """Every combination, as ``quantize_static`` keyword arguments in JSON form, weights int8, QDQ."""
    return [
        {
            "quant_format": "QDQ",
            "activation_type": activation,
            "weight_type": "QInt8",
            "per_channel": per_channel,
            "calibrate_method": method,
        }
        for activation, per_channel, method in itertools.product(ACTIVATION_TYPES, PER_CHANNEL, METHODS)
    ]


def keyword_arguments(settings: dict) -> dict:
    """``settings`` (JSON form) as the keyword arguments quantize_static takes."""
    arguments = {}
    for key, value in settings.items():
        if key == "quant_format":
            arguments[key] = QuantFormat[value]
        elif key in ENUMS:
            arguments[key] = ENUMS[key][value]
        else:
            arguments[key] = value
    return arguments


def cache_path(folder: str, method: str) -> str:
    """Where the calibration ranges of ``method`` are kept for every candidate."""
    return os.path.join(folder, f"calibration-{method}.json")


class SampleReader(CalibrationDataReader):
    """The calibration samples for one quantize_static call: a consumed reader yields nothing."""

    def __init__(self, samples: list[dict]) -> None:
        self.left = iter(samples)

    def get_next(self) -> dict | None:
        return next(self.left, None)


def quantize_candidate(
    prepared: str,
    output: str,
    settings: dict,
    make_reader: Callable[[], CalibrationDataReader],
    cache_folder: str,
) -> None:
    """``quantize_static(prepared, output, **settings)``; the first candidate of a
    calibration method calibrates (a new reader each time: a consumed one yields
    nothing) and fills the cache, the others read the ranges from it."""
    cache = cache_path(cache_folder, settings["calibrate_method"])
    reader = None if os.path.isfile(cache) else make_reader()
    with quiet():
        quantize_static(prepared, output, reader, calibration_cache_path=cache, **keyword_arguments(settings))
