"""The pytest runs the plugin's tests share (test_plugin*.py)."""

import pytest


@pytest.fixture
def run_pytest(pytester, monkeypatch):
    """``run(folder, *args)``: pytest in ``folder``, in this process (pytester's run, which
    restores every module and option after it), the plugin loaded with -p:
    ``(exit code, output)``."""

    def run(folder, *args):
        monkeypatch.chdir(folder)
        result = pytester.runpytest("-p", "graphscan_pytest", "-p", "no:cacheprovider", *args)
        return int(result.ret), "\n".join(result.outlines + result.errlines)

    return run
