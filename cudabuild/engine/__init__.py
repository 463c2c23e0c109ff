"""The build engine. Its core reads graph -> decide -> run -> store:

- graph.py: the stage table's rules (plan, dependencies, key inputs) and `Build`, the plain
  description of a build the engine is handed (cudabuild.config.BuildConfig is one), table included;
- runner.py: `Runner.decide` (cached -> restorable -> run) and running a stage; stamp.py;
- store.py: the local content-addressed store (records.py, hashing.py, files.py, diskcache_rows.py);
- beside the core: explain.py (why a stage runs), workers.py and memory.py (stages side by side),
  cache_admin.py (cache stats, verify, gc), nightly.py, cluster.py (stages that must run sent to a
  Dask cluster's workers);
- tiers/: the shared tiers behind the store; console/: the terminal, progress, trace.json, report.

It knows stages only as rows of the table it is handed (cudabuild.pipeline's), and imports neither
torch nor executorch, nor cudabuild.config, specs, registry, pipeline or backend
(tests/test_imports.py): a stage's code is imported by the module name its row gives, when it
runs, so a no-op build runs on this half alone.
"""
