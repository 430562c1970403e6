"""The image smoke test's build runs in the background from the start of the test session
(it is mostly network and disk), overlapping the CPU-bound tests; the smoke test runs last and
waits for it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.deploy.manifests import ROOT
from tests.deploy.podman import image_tag, tail_file

SMOKE_MODULE = "tests/deploy/test_image.py"
NEEDS = ("podman", "runc", "debootstrap")


def missing_for_image() -> str:
    """Why the image cannot be built and run here ('' when it can)."""
    if os.geteuid() != 0:
        return "the image smoke test needs root (rootful podman)"
    lacking = [tool for tool in NEEDS if not shutil.which(tool)]
    return f"the image smoke test needs {', '.join(lacking)} (apt)" if lacking else ""


class ImageBuild:
    """`deploy/podman/build.sh TAG` in its own process group, at low CPU priority."""

    def __init__(self, tag: str):
        self.tag = tag
        self.log = Path(tempfile.mkstemp(prefix="pdserve-image-build-", suffix=".log")[1])
        self.started = time.monotonic()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                ["nice", "-n", "10", "bash", str(ROOT / "deploy" / "podman" / "build.sh"), tag],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                # The smoke test serves tiny: the image's SmolLM2 (default) is left out here.
                env={**os.environ, "PDSERVE_MODELS": "tiny"})
        self.seconds = 0.0

    def wait(self, timeout_s: float) -> None:
        """Block until built; fail the calling test with the build's log when it did not."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"the image build took over {timeout_s:.0f}s:\n{tail_file(self.log)}")
        self.seconds = time.monotonic() - self.started
        if self.proc.returncode != 0:
            pytest.fail(f"deploy/podman/build.sh failed ({self.proc.returncode}):\n"
                        f"{tail_file(self.log)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.unlink(missing_ok=True)


_build: ImageBuild | None = None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The smoke test last, so the build has the whole session to finish in."""
    items.sort(key=lambda item: item.nodeid.startswith(SMOKE_MODULE))


def pytest_collection_finish(session: pytest.Session) -> None:
    global _build
    if any(item.nodeid.startswith(SMOKE_MODULE) for item in session.items) \
            and not missing_for_image() and _build is None:
        _build = ImageBuild(image_tag())


def pytest_sessionfinish() -> None:
    """Stop a build still running and remove the test image (1.5 GB a checkout); the layer
    cache the next build starts from stays."""
    if _build is not None:
        _build.stop()
        subprocess.run(["podman", "rmi", "--ignore", _build.tag], capture_output=True,
                       timeout=120, check=False)


@pytest.fixture(scope="session")
def image_build() -> ImageBuild:
    """The built image (the build started with the session); skips, or fails in CI, without
    podman or root."""
    from tests.deploy.manifests import cannot_run

    why = missing_for_image()
    if why:
        cannot_run(why)
    assert _build is not None, "the image build was not started at collection"
    _build.wait(timeout_s=25 * 60)
    return _build
