"""Tests that need an optional extra (torch, onnxruntime, matplotlib...) skip, with the
extra to install as the reason, where that extra is not installed; under ``CI=true``
they fail, because CI installs every extra (packaging/bootstrap.sh).

A test needs an extra when it, or a fixture it uses, or its module's imports, stop on
the extra's missing module (``ModuleNotFoundError``) or on Tandem's own
:class:`~tandem.models.extras.MissingExtra`. Hooked in by tests/conftest.py, so no test
file has to list what it needs; a module the light install must run without is held to
that separately (tests/test_light_install.py)."""

from __future__ import annotations

import os
import re

import pytest

from tandem.models.extras import EXTRA_OF, MissingExtra, installed

IN_CI = os.environ.get("CI", "").lower() == "true"


def missing_extra_reason(exc: BaseException | None) -> str | None:
    """Why ``exc`` (or an exception it was raised from) means "this extra is not installed",
    or None when it means something else (a bug, a missing file)."""
    while exc is not None:
        if isinstance(exc, MissingExtra):
            return f"needs an extra: {exc}"
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            top = exc.name.partition(".")[0]
            if top in EXTRA_OF and not installed(top):
                return f'needs {top}, not installed: pip install "tandem[{EXTRA_OF[top]}]"'
        exc = exc.__cause__ or exc.__context__
    return None


MESSAGE = re.compile(r'(\S.*?) needs (.+?), which (?:is|are) not installed: pip install "tandem\[([^\]]+)\]"')
"""The line `tandem` prints for a missing extra (models/extras.py), as a test that runs the
CLI (in this process or a child) sees it in its output or its assertion."""


def message_reason(text: str) -> str | None:
    """The reason to skip when ``text`` holds the missing-extra line for a module that is
    really not installed here (not one a test provoked on purpose with a blocker)."""
    for match in MESSAGE.finditer(text):
        if any(not installed(m) for m in re.split(r", | and ", match.group(2))):
            return f'needs an extra: {match.group(0)}'
    return None


def _as_skip(report, reason: str, where: str) -> None:
    report.outcome = "skipped"
    report.longrepr = (where, 0, f"Skipped: {reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if not IN_CI and report.failed and call.excinfo is not None:
        reason = (missing_extra_reason(call.excinfo.value)
                   or message_reason(f"{call.excinfo.value}\n{report.capstderr}\n{report.capstdout}"))
        if reason:
            _as_skip(report, reason, str(item.path))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    call = getattr(report, "call", None)  # pytest keeps the collection's CallInfo here
    if not IN_CI and report.failed and call is not None and call.excinfo is not None:
        reason = missing_extra_reason(call.excinfo.value)
        if reason:
            _as_skip(report, reason, str(collector.path))
    return report
