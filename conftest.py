"""Shared fixtures: the lab's models, built into tmp paths for many shapes.

Models come from gen_models.py's builder (one builder in the project), so the
suite measures exactly what the main job writes into ops/.
"""

from dataclasses import dataclass

import onnx
import pytest
from hypothesis import HealthCheck, settings

import gen_models

# Kept importable from here for test modules written before tests/helpers.py
# held SPEC's keys; the one copy is there.
from tests.helpers import (  # noqa: F401
    COMMANDS,
    ISLAND_KEYS,
    PER_ISLAND_KEYS,
    SINGLE_MODEL_COMMANDS,
    SPEC_KEYS,
    assert_counts_are_integers,
)


def run_onnx(path, feeds):
    """All outputs of the model at ``path`` on ``feeds``, run directly in onnxruntime
    with graph optimizations off, as graphscan runs models (Q/DQ kept as written)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


# Hypothesis profiles for tests/test_properties.py. Registered here because the plugin
# loads `--hypothesis-profile NAME` in pytest_configure, before test modules import.
# database=None: tests never write into the repository (no .hypothesis/ folder); a failure
# prints its minimal example and a reproduce blob instead.
settings.register_profile(
    "default",
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=5000,
    deadline=None,
    derandomize=False,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)


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
VARIANTS = ["fp32", "full", "matmul_only", "excluded", "dynamic"]
QDQ_VARIANTS = ["full", "matmul_only", "excluded"]


def case_params(cases=CASES):
    return [pytest.param(case, id=case.id) for case in cases]


@pytest.fixture(scope="session")
def build_case(tmp_path_factory):
    """Factory: the five variants of a case as ``{variant: path}``, built once.

    Session-scoped because quantization is the slow part and every test of a
    case reads the same files; each case gets its own tmp folder.
    """
    built = {}

    def build(case):
        if case not in built:
            folder = tmp_path_factory.mktemp(case.id)
            fp32 = folder / "fp32.onnx"
            model = gen_models.build_mlp(case.layers, case.dim, case.seed, case.input_shape)
            onnx.save(model, fp32)
            paths = gen_models.quantize_variants(fp32, folder, case.exclude, case.seed)
            built[case] = {"fp32": fp32, **paths}
        return built[case]

    return build


@pytest.fixture(params=case_params())
def case(request):
    """Every lab case, so invariants are checked on more than one shape."""
    return request.param


@pytest.fixture
def variants(build_case, case):
    """The built variants of the current case."""
    return build_case(case)
