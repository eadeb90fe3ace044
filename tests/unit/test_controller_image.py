"""A detached job's controller image: fabtrain's own is built at the first `fab train --detach`
(so `fab cluster.up` never waits for it), any other must already be in the local engine."""

import subprocess

import pytest

from orchestrator.core.errors import UserError
from orchestrator.images import images

DEFAULT = "fabtrain/controller:latest"


@pytest.fixture
def engine(monkeypatch):
    """The local engine's images (a set to edit) and the scripts run (a list)."""
    have: set[str] = set()
    ran: list[list[str]] = []

    def local_image(image):
        if image not in have:
            raise UserError(f"image {image} is not in the local Docker engine")
        return "sha256:x", 1

    def run(argv, **kwargs):
        ran.append(argv)
        have.add(DEFAULT)  # what build-controller.sh makes
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(images, "local_image", local_image)
    monkeypatch.setattr(images.subprocess, "run", run)
    return have, ran


def test_an_image_already_there_is_used_as_it_is(engine):
    have, ran = engine
    have.add(DEFAULT)
    images.controller_image(DEFAULT)
    assert ran == []


def test_fabtrains_own_is_built_from_the_base_the_first_time(engine):
    have, ran = engine
    have.add("fabtrain/base:bookworm")
    images.controller_image(DEFAULT)
    assert len(ran) == 1 and ran[0][0] == "bash" and ran[0][1].endswith("docker/build-controller.sh")


def test_without_the_base_it_says_which_scripts_build_both(engine):
    _, ran = engine
    with pytest.raises(UserError) as exc:
        images.controller_image(DEFAULT)
    assert ran == [] and str(exc.value) == (
        f"the controller image {DEFAULT} is not in this machine's Docker engine, nor fabtrain/base:bookworm "
        "to build it from; run 'bash docker/build-images.sh' and then 'bash docker/build-controller.sh'"
    )


def test_another_image_is_never_built_here(engine):
    have, ran = engine
    have.add("fabtrain/base:bookworm")
    with pytest.raises(UserError, match="image registry.example/ctl:1 is not in the local Docker engine"):
        images.controller_image("registry.example/ctl:1")
    assert ran == []
