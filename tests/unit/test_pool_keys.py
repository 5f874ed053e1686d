"""Which rank environments share a warm-pool zygote (pure: no process starts)."""

from __future__ import annotations

import os

from sparkdist._node.pool import pool as _pool


def test_the_import_environment_decides_the_zygote_not_the_shipped_code():
    env = dict(os.environ, PYTHONPATH=f"/code-of-run-7{os.pathsep}/lib")
    plain = dict(os.environ, PYTHONPATH="/lib")
    assert _pool.zygote_key(env, shipped_code="/code-of-run-7") == _pool.zygote_key(plain)
    assert _pool.zygote_key(env) != _pool.zygote_key(plain)
    for name in _pool.IMPORT_VARS:
        assert _pool.zygote_key(dict(plain, **{name: "/other"})) != _pool.zygote_key(plain)
    assert _pool.zygote_key(dict(plain, UNRELATED="1")) == _pool.zygote_key(plain)
    assert _pool.zygote_key(dict(plain, OMP_NUM_THREADS="4")) == _pool.zygote_key(plain)
