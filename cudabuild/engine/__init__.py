"""The build engine, one noun per module. Its core reads graph -> decide -> run -> settle:

- graph.py: the stage table's rules (plan, dependencies, key inputs) and `Build`, the plain
  description of a build the engine is handed (cudabuild.config.BuildConfig is one), table included;
- runner.py: `Runner.decide` (cached -> restorable -> run) and settling what ran or was found
  (restored or stored, and stamped: stamp.py), and rewinding a producer whose output went bad;
- executors.py: how a stage that must run is run (here, in a warm process, on a cluster's worker),
  handed a Job; far_end.py: the warm process's and a worker's side of that hand-off;
- stage_io.py: a running stage's I/O (upstream outputs, what it keeps, what a bad blob sets off),
  which its context (context.py) reads through; admission.py: its turn beside the build's others;
- store.py: a cache folder opened: its table (diskcache_rows.py), the object store
  (object_store.py: blobs, spans, verified paths, work folders; spans.py) and the action cache
  (action_cache.py: records, documents, the build log; restore, store, write-back);
  records.py, hashing.py, files.py beneath them;
- beside the core: explain.py (why a stage runs), workers.py and memory.py (stages side by side),
  cache_admin.py (cache stats, verify, gc), nightly.py, cluster.py (stages that must run sent to a
  Dask cluster's workers);
- tiers/: the shared tiers behind the store; console/: the terminal, progress, trace.json, report.

It knows stages only as rows of the table it is handed (cudabuild.pipeline's), and imports neither
torch nor executorch, nor cudabuild.config, specs, registry, pipeline or backend
(tests/test_imports.py): a stage's code is imported by the module name its row gives, when it
runs, so a no-op build runs on this half alone.
"""
