"""Shared fixtures: the lab's models, built into tmp paths for many shapes.

Models come from gen_models.py's builder (one builder in the project), so the
suite measures exactly what the main job writes into ops/. The cases are defined
in tests/lab.py; this file holds only fixtures and hypothesis profiles, and test
modules never import from it.
"""

import onnx
import pytest
from hypothesis import HealthCheck, settings

import gen_models
from tests.lab import DEFAULT_LAB, SMALL_LAB, TRACE_LAB, case_params

pytest_plugins = ["pytester"]  # the plugin's tests run the graphscan plugin in pytest, in process (run_pytest)

# Hypothesis profiles for tests/counting/test_properties.py. Registered here because the plugin
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


@pytest.fixture(scope="session")
def build_case(tmp_path_factory):
    """Factory: the five variants of a case as ``{variant: absolute path str}``, built once.

    Strings, as users pass paths on the command line: they go to ``main(argv)``
    and are echoed unchanged in answers.

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
            built[case] = {variant: str(path) for variant, path in {"fp32": fp32, **paths}.items()}
        return built[case]

    return build


@pytest.fixture(scope="session")
def default_lab(build_case):
    """The lab's default models (tests/lab.py DEFAULT_LAB) as ``{variant: path str}``."""
    return build_case(DEFAULT_LAB)


@pytest.fixture(scope="session")
def small_lab(build_case):
    """The smallest lab case (SMALL_LAB: 3 layers, input x [N, 8]) as ``{variant: path str}``."""
    return build_case(SMALL_LAB)


@pytest.fixture(scope="session")
def trace_lab(build_case):
    """The case trace and impact measure (TRACE_LAB: 4 layers, 16 wide) as ``{variant: path str}``."""
    return build_case(TRACE_LAB)


@pytest.fixture(params=case_params())
def case(request):
    """Every lab case, so invariants are checked on more than one shape."""
    return request.param


@pytest.fixture
def variants(build_case, case):
    """The built variants of the current case."""
    return build_case(case)


@pytest.fixture(scope="session")
def fresh_install(tmp_path_factory):
    """graphscan ``pip install``-ed from a copy of the repository into a new venv (its bin
    folder), once per test session: the package's tests and the plugin's share it."""
    from tests.helpers import install_into_fresh_venv

    return install_into_fresh_venv(tmp_path_factory.mktemp("fresh_install"), index=False)


@pytest.fixture
def run_pytest(pytester, monkeypatch):
    """``run(folder, *args)``: pytest in ``folder``, in this process (pytester's run, which
    restores every module and option after it), the plugin loaded with -p:
    ``(exit code, output)``. The plugin's tests share it (tests/cli/test_plugin*.py and the
    report's pages, tests/report/test_gate_pages.py). Without hypothesis's plugin: a user's
    gate needs none, and each xdist worker of ``-n 2`` would import it (0.6 s)."""

    def run(folder, *args):
        monkeypatch.chdir(folder)
        result = pytester.runpytest(
            "-p", "graphscan_pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", *args
        )
        return int(result.ret), "\n".join(result.outlines + result.errlines)

    return run
