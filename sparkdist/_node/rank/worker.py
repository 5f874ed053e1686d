"""One rank's process: bootstrap, wait for the rendezvous port, run the job, record the outcome.

Started by the agent as ``python -m sparkdist._node.rank.worker`` with the rank's torchrun
environment and two pipes: commands from the agent (``SPARKDIST_CTRL_IN``) and notices to it
(``SPARKDIST_CTRL_OUT``), one ``protocol`` message a line (``Route.WORKER``), both ways. The
worker starts before the rendezvous is complete, so its interpreter start-up and imports overlap
with the store coming up:

1. rank 0 binds a ``TCPStore`` on an OS-chosen port and keeps it for its whole life (no
   find-a-free-port race), then tells the agent the port;
2. every worker unpickles the job while it waits for the ``protocol.Rendezvous`` (the port);
3. it sets ``MASTER_PORT`` and runs the function, script or module, then destroys a process
   group the user left open and writes ``rank-N.value`` or ``rank-N.failure`` atomically.

End of file on the command pipe means the agent is gone: the worker kills its own process group
at once, so no rank outlives its launcher. SIGTERM is a preemption notice (``drain``).

Non-goals: output forwarding (the agent reads our stdout/stderr), deciding the environment.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import runpy
import sys
import time
import traceback
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from sparkdist._checkpoint.api import wait_for_pending_saves
from sparkdist._core.env import CTRL_IN_VAR as CTRL_IN_VAR
from sparkdist._core.env import CTRL_OUT_VAR as CTRL_OUT_VAR
from sparkdist._core.env import (
    DEEPSPEED_CONFIG_VAR,
    GLOO_SOCKET_IFNAME_VAR,
    HOST_VAR,
    MODE_VAR,
    PARENT_PID_VAR,
    USE_GPU_VAR,
    device_index,
)
from sparkdist._core.env import JOB_FILE_VAR as JOB_FILE_VAR
from sparkdist._core.env import RESULT_DIR_VAR as RESULT_DIR_VAR
from sparkdist._core.env import START_TIMEOUT_VAR as START_TIMEOUT_VAR
from sparkdist._core.errors import RankFailure
from sparkdist._core.run.rendezvous import diagnose
from sparkdist._core.run_dir import STACK_DUMP_SIGNAL, failure_path, value_path
from sparkdist._node.host.parent_death import die_with_parent
from sparkdist._node.rank import agent_link, drain
from sparkdist._wire import protocol

#: The store rank 0 hosts; a module global so it lives exactly as long as the process.
_store: Any = None


def main() -> None:
    faulthandler.enable()  # a segfault in a rank prints its Python stack into its output
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    env = os.environ
    parent = env.pop(PARENT_PID_VAR, None)
    if parent is not None:  # started cold: end with the agent's thread that started us
        die_with_parent(int(parent))
    link = agent_link.connect(int(env.pop(CTRL_IN_VAR)), int(env.pop(CTRL_OUT_VAR)))
    rank = link.rank = int(env["RANK"])
    result_dir = link.run_dir = env.pop(RESULT_DIR_VAR)
    drain.install(rank, result_dir, link.send)  # SIGTERM: a preemption notice, not an end
    job_file = env.pop(JOB_FILE_VAR)
    start_timeout_s = float(env.pop(START_TIMEOUT_VAR, "300"))
    try:
        if rank == 0:
            link.send(protocol.Store(_host_store(env, start_timeout_s)))
        job = _load_job(job_file)
        if not link.rendezvous.wait(start_timeout_s):
            raise TimeoutError(
                f"rank {rank} got no rendezvous port within {start_timeout_s} s "
                f"({_network_of(env)})"
            )
        env.update(link.rank_env)  # CUDA_VISIBLE_DEVICES too: nothing has started CUDA yet
        env["MASTER_PORT"] = str(link.master_port)
        _bind_device(env)
        _prepare_mode(env)
        link.send(protocol.Ready(rank))
        if env.get(MODE_VAR) == "deepspeed":
            from sparkdist._node.rank.torch_extensions import prepare_deepspeed_rank

            prepare_deepspeed_rank(env)  # no wait on a dead build's lock, no op build in the run
        value = _run(job)
        _wait_for_pending_checkpoints()  # an async save still writing is part of the run
        _destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - every way out of user code is recorded
        code = _exit_code_of(exc)
        if code == 0:
            _write_atomically(value_path(result_dir, rank), _dumps(None))
            _exit(0, link)
        _write_failure(result_dir, rank, exc, code)
        _exit(code, link)
    else:
        try:
            data = _dumps(value)
        except Exception as exc:
            failure = RuntimeError(
                f"the return value of rank {rank} ({type(value).__qualname__}) cannot be "
                f"pickled to send it to the driver: {exc}"
            )
            _write_failure(result_dir, rank, failure, 1)
            _exit(1, link)
        _write_atomically(value_path(result_dir, rank), data)
        _exit(0, link)


def _network_of(env: Mapping[str, str]) -> str:
    """What this rank was told of the network, for its rendezvous errors."""
    interface = env.get(GLOO_SOCKET_IFNAME_VAR)
    said = f"MASTER_ADDR {env.get('MASTER_ADDR', '?')}"
    return said + (f", interface {interface}" if interface else ", no interface set")


def _host_store(env: os._Environ[str], timeout_s: float) -> int:
    global _store
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined,unused-ignore]

    _store = TCPStore(
        env["MASTER_ADDR"],
        0,
        int(env["WORLD_SIZE"]),
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return int(_store.port)


def _load_job(path: str) -> Any:
    import cloudpickle

    with open(path, "rb") as f:
        return cloudpickle.load(f)


def _bind_device(env: os._Environ[str]) -> None:
    """Bind this rank to its GPU before user code runs: LOCAL_RANK among the visible ones
    (its host's GPUs, in local-rank order), or where its own GPU stands among them."""
    if env.get(USE_GPU_VAR) != "1":
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(device_index(env))


def _prepare_mode(env: os._Environ[str]) -> None:
    """Check, in the rank's own interpreter, that the mode's machinery is there."""
    mode = env.get(MODE_VAR)
    if mode == "fsdp":
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            import torch

            raise RuntimeError(
                f"mode='fsdp' needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6) "
                f"but this rank runs torch {torch.__version__}; upgrade torch or use "
                "mode='ddp'"
            ) from None


def _deepspeed_argv(env: os._Environ[str]) -> list[str]:
    """What pyspark's DeepspeedTorchDistributor appends to a script's arguments."""
    if env.get(MODE_VAR) != "deepspeed":
        return []
    path = env.get(DEEPSPEED_CONFIG_VAR)
    return ["--deepspeed", "--deepspeed_config", path] if path else ["--deepspeed"]


def _run(job: Any) -> Any:
    from sparkdist._wire.payload import TargetKind

    if job.kind is TargetKind.FUNCTION:
        return job.fn(*job.args, **job.kwargs)
    sys.argv = [job.target, *job.argv, *_deepspeed_argv(os.environ)]
    if job.kind is TargetKind.SCRIPT:
        sys.path.insert(0, os.path.dirname(os.path.abspath(job.target)))
        runpy.run_path(job.target, run_name="__main__")
    else:
        runpy.run_module(job.target, run_name="__main__", alter_sys=True)
    return None


def _wait_for_pending_checkpoints() -> None:
    """Finish (and commit) an async ``runtime.save_checkpoint`` still writing, while the
    process group its collectives use is up; a failed write becomes this rank's failure."""
    wait_for_pending_saves()  # imports nothing, and returns at once, when none is pending


def _destroy_process_group() -> None:
    """Destroy a process group the user left open, so the interpreter exits cleanly."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _exit_code_of(exc: BaseException) -> int:
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        return 1  # sys.exit("message"): Python prints it and exits 1
    return 1


def _write_failure(result_dir: str, rank: int, exc: BaseException, code: int) -> None:
    failed_at = time.time()  # first: the root cause is the rank that failed earliest
    exc_type = type(exc)
    if isinstance(exc, SystemExit):
        message = f"exited with code {code}"
        if not isinstance(exc.code, int) and exc.code is not None:
            message += f": {exc.code}"
            print(exc.code, file=sys.stderr)
        type_name, text = "SystemExit", ""
    else:
        message = str(exc)
        type_name = exc_type.__qualname__
        if exc_type.__module__ not in ("builtins", "__main__"):
            type_name = f"{exc_type.__module__}.{type_name}"
        text = "".join(traceback.format_exception(exc_type, exc, _user_frames(exc.__traceback__)))
    # A failed init_process_group names the node and what it could not reach (this process's
    # environment knows both); any other failure gets None.
    diagnosis = diagnose(type_name, message, os.environ)
    failure = RankFailure(
        rank=rank,
        host=os.environ.get(HOST_VAR, ""),
        exit_code=code,
        exc_type=type_name,
        message=message,
        traceback=text,
        exception_bytes=_try_dumps(exc),
        failed_at=failed_at,
        diagnosis=diagnosis.text() if diagnosis is not None else "",
    )
    _write_atomically(failure_path(result_dir, rank), _dumps(failure))


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Skip the frames of this module (and runpy) so the traceback starts in user code."""
    skip = (__file__, runpy.__file__)
    while tb is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next
    return tb


def _dumps(value: Any) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(value)  # type: ignore[no-any-return]


def _try_dumps(exc: BaseException) -> bytes | None:
    try:
        data = _dumps(exc)
        _ = _loads_check(data)
    except Exception:
        return None
    return data


def _loads_check(data: bytes) -> Any:
    import cloudpickle

    return cloudpickle.loads(data)


def _write_atomically(path: str, data: bytes) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def _skip_teardown_only_finalizers() -> None:
    """Don't run torch's op-library finalizers at exit: there are 100+ of them, they only
    undo registrations in this process's memory (which ``os._exit`` discards anyway), and
    they cost ~40 ms per rank."""
    try:
        registry = weakref.finalize._registry  # type: ignore[attr-defined]
        for finalizer, info in list(registry.items()):
            if getattr(info.func, "__module__", "") == "torch.library":
                finalizer.atexit = False
    except Exception:  # a private structure: if it changes, exit the slow way
        pass


def _exit(code: int, link: agent_link.AgentLink) -> None:
    """Tell the agent the outcome is written, run the atexit hooks user code and libraries rely
    on, flush, and leave at once.

    The agent bounds what follows (``watchdog.EXIT_AFTER_DONE_S``): an atexit hook or a library
    thread that never lets the process end cannot hold the run once its outcome is in.
    Skipping interpreter teardown matters: destroying torch's C++ objects (rank 0's store
    server thread above all) while peers are still connected can abort the process
    ("terminate called without an active exception") after its result was already written.
    This is what multiprocessing does for its children too.
    """
    code = code if 0 <= code <= 255 else 1
    link.send(protocol.Done(link.rank, code))
    _skip_teardown_only_finalizers()
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a failing hook must not change the outcome
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
