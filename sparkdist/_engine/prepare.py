"""Everything decided before any process starts: validate, pickle, place, plan.

``prepare`` runs on the caller's thread, so whatever can be refused is refused there, before
anything is launched (``sparkdist run --dry-run`` stops after it and prints the plan).

Non-goals: starting or watching the run (``launch``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sparkdist._backends.base import Backend
from sparkdist._backends.choose import select_backend
from sparkdist._backends.job_file import job_file_name
from sparkdist._core.env import (
    CHECKPOINT_DIR_VAR,
    REQUESTED_WORLD_SIZE_VAR,
    STORAGE_OPTIONS_VAR,
)
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import TORCH_IGNORE_SSL_KEY
from sparkdist._core.launch.plan import LaunchPlan, make_plan
from sparkdist._core.object_store import encode_options
from sparkdist._core.versions import expected_requirements
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._shipping.code import ModuleRecorder, pack_local_code
from sparkdist._wire.captures import check_job_size
from sparkdist._wire.payload import Job, dumps_job


@dataclass(frozen=True)
class PreparedLaunch:
    """Everything decided before any process starts: the plan, and what executes it."""

    run_id: str
    plan: LaunchPlan
    backend: Backend
    template: AgentSpec
    job_bytes: bytes


def prepare(
    config: LaunchConfig,
    job: Job,
    *,
    session: Any | None = None,
    ignore_ssl_key: str = TORCH_IGNORE_SSL_KEY,
    dataframe: Any | None = None,
    extra_env: Mapping[str, str] = {},
) -> PreparedLaunch:
    """Validate, pickle, place and plan a run on the caller's thread; start nothing.

    Everything that can be refused is refused here (``sparkdist run --dry-run`` stops here and
    prints ``plan.describe()``). ``extra_env``: variables the launcher sets for every rank
    besides its own (a replica group's torchft variables).
    """
    backend = select_backend(config, session, ignore_ssl_key=ignore_ssl_key, dataframe=dataframe)
    recorder = ModuleRecorder()
    job_bytes = dumps_job(job, on_object=recorder)
    large = check_job_size(
        job,
        len(job_bytes),
        config.job_size_warn_mb,
        config.job_size_limit_mb,
        local_mode=not backend.ships_large_jobs,
    )
    wanted = expected_requirements(
        config.mode.value, config.requirements, pinned_only=not backend.ships_large_jobs
    )
    code_zip = pack_local_code(recorder.names, visible_dirs=backend.visible_code_dirs())
    placement = backend.place(config)
    requirements = backend.requirements(config, wanted)
    job_as_file = large and backend.ships_large_jobs
    run_id = uuid.uuid4().hex[:12]
    plan = make_plan(
        config,
        placement,
        backend=backend.kind,
        job_name=job.name,
        job_size_bytes=len(job_bytes),
        job_as_file=job_as_file,
        requirements=[
            r.name if r.version is None else f"{r.name}=={r.version}" for r in requirements
        ],
    )
    extra_env = {
        **backend.rank_env(config),
        **config.env,
        REQUESTED_WORLD_SIZE_VAR: str(config.num_processes),
        **extra_env,
    }
    if config.checkpoint_dir is not None:
        extra_env[CHECKPOINT_DIR_VAR] = config.checkpoint_dir
    if config.storage_options:
        extra_env[STORAGE_OPTIONS_VAR] = encode_options(config.storage_options)
    host = backend.driver_host
    template = AgentSpec(
        run_id=run_id,
        job_bytes=b"" if job_as_file else job_bytes,
        node_rank=0,
        num_nodes=placement.num_tasks,
        processes_per_node=placement.processes_per_task,
        master_addr=host,
        host=host,
        channel_address=(host, 0),
        secret="",
        gpu_addresses=",".join(placement.driver_gpus) if placement.use_gpu else None,
        mode=config.mode.value,
        start_timeout_s=config.start_timeout_s,
        extra_env=extra_env,
        max_restarts=config.max_restarts,
        gpu_type=config.gpu_type,
        deepspeed_config_json=(
            json.dumps(dict(config.deepspeed_config))
            if config.deepspeed_config is not None
            else None
        ),
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        requirements=requirements,
        code_zip=code_zip,
        job_file=job_file_name(run_id) if job_as_file else None,
        system_metrics_interval_s=config.system_metrics_interval_s,
    )
    return PreparedLaunch(run_id, plan, backend, template, job_bytes)
