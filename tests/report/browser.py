"""Headless Chromium (Debian's ``chromium``) for the report's browser tests, network off.

    python -m tests.report.browser install       # apt-get install chromium, as root (CI)
    python -m tests.report.browser shot PAGE.html OUT.png [WIDTH HEIGHT]

``dump(page)`` is the page's DOM after the browser rendered it and the console lines it
logged; ``screenshot(page, png)`` a picture of it. The browser runs with no proxy that works,
every host name unresolvable and its own background traffic off, so a page that reached for
the network would show it (a CSP violation or a failed load is a console line).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NAMES = ("chromium", "chromium-browser")
OFFLINE = [
    "--headless",
    "--no-sandbox",  # root in CI and here
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",  # screenshots of the page alone
    "--proxy-server=127.0.0.1:9",  # discard: no request leaves
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--enable-logging=stderr",
    "--v=0",
]
CONSOLE = re.compile(r'CONSOLE(?::\d+|\(\d+\))\] "(.*)", source: (.*)')  # "INFO:CONSOLE:0]" or "CONSOLE(0)]"
TIMEOUT = 120


def executable() -> str | None:
    """The browser's path (None: not installed)."""
    return next((found for name in NAMES if (found := shutil.which(name))), None)


def run(page: Path, *flags: str, width: int = 1200, height: int = 900) -> subprocess.CompletedProcess[str]:
    """The browser on ``page`` with ``flags``, in a profile of its own that is removed after."""
    browser = executable()
    assert browser is not None, "chromium is not installed: python -m tests.report.browser install"
    with tempfile.TemporaryDirectory(prefix="graphscan-chromium-") as profile:
        command = [browser, *OFFLINE, f"--user-data-dir={profile}", f"--window-size={width},{height}", *flags]
        return subprocess.run(
            [*command, page.resolve().as_uri()],
            capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip


def console_lines(stderr: str) -> list[str]:
    """The page's console messages the browser logged (errors, CSP violations, failed loads)."""
    return [f"{m.group(1)} ({m.group(2)})" for m in CONSOLE.finditer(stderr)]


def dump(page: Path) -> tuple[str, list[str]]:
    """``(the rendered DOM, the console lines)`` of ``page``."""
    done = run(page, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, console_lines(done.stderr)


def screenshot(page: Path, png: Path, width: int = 1200, height: int = 900) -> list[str]:
    """A picture of ``page`` in a ``width`` x ``height`` window into ``png``; the console lines."""
    done = run(page, f"--screenshot={png.resolve()}", width=width, height=height)
    assert done.returncode == 0 and png.is_file(), done.stderr[-2000:]
    return console_lines(done.stderr)


def install() -> int:
    """Debian's chromium, unless a browser is here (as root, with apt-get)."""
    if executable():
        return 0
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print("install Debian's chromium as root: apt-get install -y chromium", file=sys.stderr)
        return 2
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for step in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        done = subprocess.run(step, env=environment, stdin=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            return done.returncode
    return 0 if executable() else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["install"]:
        return install()
    if argv[:1] == ["shot"] and len(argv) in (3, 5):
        size = [int(v) for v in argv[3:5]] or [1200, 900]
        for line in screenshot(Path(argv[1]), Path(argv[2]), *size):
            print(line, file=sys.stderr)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
