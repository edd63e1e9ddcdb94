"""The benchmark probes wrap product functions by name from outside (bench/resume_probe.py): a function that moved
made `python -m bench resume` fail at its first relaunch, found only when someone ran it. Here a rename fails."""

from __future__ import annotations

import pytest

from bench.resume_probe import TARGETS, target


@pytest.mark.parametrize(("module", "attribute", "mark"), TARGETS, ids=[t[2] for t in TARGETS])
def test_every_function_the_resume_probe_wraps_exists(module, attribute, mark):
    owner, name = target(module, attribute)
    assert callable(getattr(owner, name)), f"{module}.{attribute} ({mark})"
