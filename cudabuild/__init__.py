"""cudabuild: a content-keyed build graph for lowering PyTorch models through AOTInductor.

Two halves: cudabuild.engine (graph, runner, store, tiers, explain, console, cache tools) and
cudabuild.backend (the ExecuTorch/CUDA stages and what they use). cudabuild.pipeline joins them:
the table of stages. Top-level modules are shared vocabulary: config, specs, recipes, errors, cli.

Importing this package must stay cheap: it never imports torch or executorch. Heavy imports live
inside the stage functions that need them (see cudabuild/backend/stages/).
"""

__version__ = "0.1.0"
