"""The build engine: the stage graph, running a stage against the cache, the store and its shared
tiers, explain, the console and timeline, and the cache tools.

It knows stages only as rows of a table (cudabuild.pipeline) and never imports torch, executorch
or anything under cudabuild.backend at module load: a no-op build runs on this half alone.
"""
