"""An elastic restart's count of barrier slots, against a scripted view of Spark's executors
(a fake SparkContext: the counting logic is pure; the lab runs it against a real cluster)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sparkdist import ClusterError
from sparkdist._backends import capacity


@dataclass
class Executor:
    host: str
    cores: int = 1
    name: str = ""  # the id's distinguishing part, where a host has several
    active: int = 0  # tasks running on it

    def id(self) -> str:
        return f"exec-{self.host}{self.name}"

    def hostPort(self) -> str:  # noqa: N802 - Spark's name
        return f"{self.host}:40000"

    def totalCores(self) -> int:  # noqa: N802 - Spark's name
        return self.cores

    def activeTasks(self) -> int:  # noqa: N802 - Spark's name
        return self.active


@dataclass
class Listing:
    items: list[Executor]

    def size(self) -> int:
        return len(self.items)

    def apply(self, i: int) -> Executor:
        return self.items[i]


@dataclass
class FakeSpark:
    """Spark's executors over time: ``views[i]`` is what the i-th look sees (the last one
    stays). ``sparkContext._jsc.sc()`` is this object."""

    views: list[list[Executor]]
    looks: int = 0
    clock_s: float = 0.0
    seen: list[int] = field(default_factory=list)
    given_up: set[str] = field(default_factory=set)  # listed, but no longer offered tasks

    @property
    def sparkContext(self) -> FakeSpark:  # noqa: N802 - Spark's name
        return self

    @property
    def _jsc(self) -> FakeSpark:
        return self

    def sc(self) -> FakeSpark:
        return self

    def _now(self) -> list[Executor]:
        return self.views[min(self.looks, len(self.views) - 1)]

    def statusStore(self) -> FakeSpark:  # noqa: N802
        return self

    def executorList(self, active: bool) -> Listing:  # noqa: N802
        self.looks += 1
        self.clock_s += 1.0  # each look costs a second of the fake clock
        return Listing(self._now())

    def resourceProfileManager(self) -> FakeSpark:  # noqa: N802
        return self

    def defaultResourceProfile(self) -> None:  # noqa: N802
        return None

    def maxNumConcurrentTasks(self, profile: object) -> int:  # noqa: N802
        return sum(e.cores for e in self._now() if e.id() not in self.given_up)

    def schedulerBackend(self) -> FakeSpark:  # noqa: N802
        return self

    def isExecutorActive(self, executor_id: str) -> bool:  # noqa: N802
        return executor_id not in self.given_up

    def statusTracker(self) -> FakeSpark:  # noqa: N802
        return self

    def getExecutorInfos(self) -> list[object]:  # noqa: N802
        return [object()] * (len(self._now()) + 1)  # the driver is listed too

    def clock(self) -> float:
        return self.clock_s


@pytest.fixture(autouse=True)
def no_real_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity.time, "sleep", lambda s: None)


A, B, C = Executor("10.0.0.1"), Executor("10.0.0.2"), Executor("10.0.0.3")


def test_a_killed_hosts_executor_is_waited_out_then_the_rest_counted() -> None:
    spark = FakeSpark([[A, B, C], [A, B, C], [A, B]])  # Spark drops C on the third look
    found = capacity.wait_for_capacity(
        spark, fewest_tasks=2, lost_executors={C.id()}, task_cpus=1, wait_s=60, clock=spark.clock
    )
    assert found == 2


def test_a_cut_off_hosts_executor_still_listed_is_subtracted_after_the_settle() -> None:
    spark = FakeSpark([[A, B, C]])  # a cut-off host: Spark lists it for minutes
    found = capacity.wait_for_capacity(
        spark, fewest_tasks=2, lost_executors={C.id()}, task_cpus=1, wait_s=60, clock=spark.clock
    )
    assert found == 2
    assert spark.clock_s >= capacity.LOST_EXECUTORS_SETTLE_S  # it gave Spark the settle first


def test_a_given_up_executor_still_listed_is_not_taken_out_twice() -> None:
    # A cut-off host's executor given up before the restart: the status store lists it until
    # its end is confirmed (never, behind a cut), the scheduler offers it nothing already.
    spark = FakeSpark([[A, B, C]], given_up={C.id()})
    found = capacity.wait_for_capacity(
        spark, fewest_tasks=2, lost_executors={C.id()}, task_cpus=1, wait_s=60, clock=spark.clock
    )
    assert found == 2
    assert spark.clock_s < capacity.LOST_EXECUTORS_SETTLE_S  # nothing to wait out


def test_below_min_processes_it_waits_for_capacity_that_comes() -> None:
    spark = FakeSpark([[A], [A], [A], [A, B]])
    found = capacity.wait_for_capacity(
        spark, fewest_tasks=2, lost_executors=set(), task_cpus=1, wait_s=60, clock=spark.clock
    )
    assert found == 2


def test_below_min_processes_after_start_timeout_it_fails_saying_what_it_found() -> None:
    spark = FakeSpark([[A, C]])
    with pytest.raises(ClusterError) as info:
        capacity.wait_for_capacity(
            spark,
            fewest_tasks=2,
            lost_executors={C.id()},
            task_cpus=1,
            wait_s=20,
            clock=spark.clock,
        )
    message = str(info.value)
    assert "needs at least 2 barrier task slot(s) (min_processes) but found 1" in message
    assert "leaving out the lost executor(s) exec-10.0.0.3" in message
    assert "start_timeout_s" in message and "lower min_processes" in message


def test_cores_count_in_slots_of_task_cpus() -> None:
    by_executor = capacity.executor_slots(
        FakeSpark([[Executor("a", 4), Executor("b", 3)]]), task_cpus=2
    )
    assert by_executor == {"exec-a": 2, "exec-b": 1}


def test_a_lost_executor_leaves_its_hosts_other_executors_counted() -> None:
    # YARN, local-cluster: two executors on one host, one of them lost (and still listed).
    lost, sibling = Executor("10.0.0.1"), Executor("10.0.0.1")
    lost.name, sibling.name = "1", "2"
    spark = FakeSpark([[lost, sibling, B]])
    found = capacity.wait_for_capacity(
        spark, fewest_tasks=1, lost_executors={lost.id()}, task_cpus=1, wait_s=60, clock=spark.clock
    )
    assert found == 2  # before: the host's every slot left out (1)
