"""The lab's cases, defined once: shapes of gen_models.py's MLP the suite builds.

conftest.py's fixtures build them (``build_case``, ``default_lab``, ``trace_lab``,
``small_lab``); test modules import the cases from here, never from conftest.
"""

from dataclasses import dataclass

import pytest

import gen_models


@dataclass(frozen=True)
class Case:
    """One shape of the lab: layer count, input shape, the node excluded."""

    layers: int
    input_shape: tuple
    exclude: str
    dim: int = 8
    seed: int = 0

    @property
    def id(self):
        rank = len(self.input_shape) + 1
        return f"{self.layers}-layers-{rank}d-dim{self.dim}-exclude-{self.exclude}"


# Lists, never sets: every xdist worker must collect the same order.
CASES = [
    Case(3, ("N",), "fc2_matmul"),
    Case(3, ("N", 5), "fc1_add"),
    Case(4, ("N",), "fc2_add"),
    Case(4, ("N", 3), "fc4_matmul"),
    Case(6, ("N",), "fc1_matmul"),
    Case(6, ("N", 2), "fc3_matmul"),
    Case(6, ("N",), "fc6_add"),
]
# The lab's default models, exactly as `python gen_models.py` builds them.
DEFAULT_LAB = Case(
    gen_models.DEFAULT_LAYERS,
    ("N",),
    gen_models.default_exclude(gen_models.DEFAULT_LAYERS),
    dim=gen_models.DEFAULT_DIM,
    seed=gen_models.DEFAULT_SEED,
)
# The smallest case (3 layers, 8 wide): process-level tests that only need a model.
SMALL_LAB = CASES[0]
# The case trace and impact measure: 4 layers, 16 wide, the second MatMul left float.
TRACE_LAB = Case(4, ("N",), "fc2_matmul", dim=16)

VARIANTS = ["fp32", "full", "matmul_only", "excluded", "dynamic"]
QDQ_VARIANTS = ["full", "matmul_only", "excluded"]


def case_params(cases=CASES):
    return [pytest.param(case, id=case.id) for case in cases]
