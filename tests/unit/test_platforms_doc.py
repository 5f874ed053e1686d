"""docs/platforms.md says what the code does: its range table is ``_core.supported``'s, its
doctor lines are the doctor's, every Spark conf it gives schedules one task per GPU by
sparkdist's own check, and every wheel it names is the one this version builds."""

from __future__ import annotations

import re

import pytest
import tomllib

from sparkdist._core.supported import SUPPORTED
from sparkdist._doctor.ranges import in_range
from sparkdist._doctor.spark import TASK_GPU_KEY, check_gpu_conf
from sparkdist._doctor.table import Status
from tests.conftest import REPO

PAGE = (REPO / "docs" / "platforms.md").read_text()
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def _blocks(info: str) -> list[str]:
    return re.findall(rf"```{info}\n(.*?)```", PAGE, re.DOTALL)


def test_the_range_table_is_the_one_the_code_defines():
    table = PAGE.split("<!-- supported-range -->\n", 1)[1].split("\n\n", 1)[0].splitlines()
    rows = [line for line in table[2:]]
    assert rows == [f"| {e.name} | `{e.specifier}` | {e.why} |" for e in SUPPORTED]


def test_the_doctor_lines_shown_are_the_doctors():
    [shown] = [block for block in _blocks("text") if block.startswith("doctor:")]
    inside, outside = in_range("pyspark", "3.5.0"), in_range("mlflow", "2.20.4")
    assert f"doctor: pyspark: {inside.status.value}, {inside.detail}\n" in shown
    assert f"doctor: mlflow: {outside.status.value}, {outside.detail}\n" in shown
    assert f"fix: {outside.fix}" in shown


def _confs() -> dict[str, dict[str, str]]:
    """Every Spark conf the page gives: its properties blocks, and the ``--conf`` (and
    Dataproc's ``--properties spark:``) settings of each command."""
    confs: dict[str, dict[str, str]] = {}
    for name, block in re.findall(
        r"<!-- spark-conf: (\w+) -->\s*```properties\n(.*?)```", PAGE, re.DOTALL
    ):
        confs[name] = dict(line.split(None, 1) for line in block.strip().splitlines())
    for number, block in enumerate(_blocks("bash")):
        command = block.replace("\\\n", " ")
        settings = re.findall(r"--conf (spark\.[\w.]+)=(\S+)", command)
        for group in re.findall(r"--properties (\S+)", command):
            settings += [
                tuple(item.removeprefix("spark:").split("=", 1)) for item in group.split(",")
            ]
        if settings:
            confs[f"bash block {number}"] = dict(settings)
    return confs


CONFS = _confs()


def test_the_page_gives_a_conf_for_every_platform_that_needs_one():
    assert {"databricks", "emr"} <= set(CONFS) and len(CONFS) >= 5, sorted(CONFS)


@pytest.mark.parametrize("name", sorted(CONFS))
def test_each_conf_schedules_one_rank_per_gpu_by_sparkdists_own_check(name):
    conf = CONFS[name]
    gpu_conf = {k: v for k, v in conf.items() if ".resource.gpu." in k}
    assert all(key.startswith("spark.") for key in conf), conf
    assert gpu_conf.get(TASK_GPU_KEY) == "1", conf
    check = check_gpu_conf(gpu_conf, name, gpus_here=True)
    # A NOTE may only say the discovery script is not on this machine (it is on the cluster's).
    assert check.status is not Status.PROBLEM, check
    assert "1 per task (1 rank(s) per barrier task)" in check.detail, check


def test_every_wheel_named_is_the_one_this_version_builds():
    names = set(re.findall(r"sparkdist-[\w.]+?-py3-none-any\.whl", PAGE))
    assert names == {f"sparkdist-{VERSION}-py3-none-any.whl"}, names


def test_the_readme_links_the_page():
    assert "(docs/platforms.md" in (REPO / "README.md").read_text()
