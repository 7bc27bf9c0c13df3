"""Repository-wide test set-up: registers the shared fixtures of `testing.fixtures` (models, shard and launcher
processes, clients) once for every test directory.

Plain helpers are imported from their modules: `testing.models` (`build_model`), `testing.shards`
(`ShardProcess`, `spawn_shards`, `ShardHandle`, `shard_stub`, `unique_uds_path`), `testing.launcher`
(`LauncherProcess`, `run_launcher`, `short_uds_prefix`), `textgen_common.ports` (`free_port`).
"""

pytest_plugins = ["testing.fixtures"]
