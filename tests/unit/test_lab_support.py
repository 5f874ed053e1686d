"""Whether the multi-host lab runs here, or why its tests skip: a pure decision."""

from __future__ import annotations

import pytest

from sparkdist._lab.lab import NameResolution, _topmost
from sparkdist._lab.support import LAB_VAR, LabFacts, decide, unshare_prefix

ALL_TOOLS = {"unshare": True, "nsenter": True, "ip": True, "java": True}


def facts(**changes: object) -> LabFacts:
    base: dict[str, object] = dict(
        platform="linux",
        euid=0,
        tools=ALL_TOOLS,
        max_user_namespaces=1000,
        disabled=False,
        trial_error="",
    )
    base.update(changes)
    return LabFacts(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "ok", "reason", "rootless"),
    [
        ({}, True, "", False),
        ({"euid": 1000}, True, "", True),
        ({"euid": 1000, "max_user_namespaces": 0}, False, "root or rootless user namespaces", True),
        ({"disabled": True}, False, f"{LAB_VAR}=0", False),
        ({"platform": "darwin"}, False, "needs Linux namespaces", False),
        ({"tools": {**ALL_TOOLS, "ip": False}}, False, "needs ip on PATH", False),
        ({"tools": {**ALL_TOOLS, "java": False, "nsenter": False}}, False, "nsenter, java", False),
        (
            {"trial_error": "unshare: unshare failed: Operation not permitted"},
            False,
            "Operation not permitted",
            False,
        ),
        # The first thing missing is the reason: tools before permissions.
        (
            {"euid": 1000, "max_user_namespaces": 0, "tools": {**ALL_TOOLS, "unshare": False}},
            False,
            "needs unshare",
            True,
        ),
    ],
)
def test_the_decision_and_its_reason(changes, ok, reason, rootless):
    verdict = decide(facts(**changes))
    assert verdict.ok is ok
    assert reason in verdict.reason
    if ok:
        assert verdict.rootless is rootless


def test_the_holder_is_one_unshare_that_dies_whole():
    prefix = unshare_prefix(rootless=False)
    assert prefix[0] == "unshare"
    for flag in ("--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"):
        assert flag in prefix
    assert "--user" not in prefix
    assert unshare_prefix(rootless=True)[1:3] == ["--user", "--map-root-user"]


def test_paths_kept_visible_under_a_hosts_private_tmp_are_the_topmost_ones():
    assert _topmost(["/tmp/a/venv", "/tmp/a", "/tmp/b", "/tmp/ab"]) == [
        "/tmp/a",
        "/tmp/ab",
        "/tmp/b",
    ]


def test_name_resolutions_are_a_closed_set():
    assert {r.value for r in NameResolution} == {"peers", "loopback", "side"}
