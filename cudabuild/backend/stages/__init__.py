"""The stage functions: one module per stage, each with `run(ctx) -> StageResult`.

They are the only code that imports torch and executorch, and they are imported only when a
stage actually runs (cudabuild.engine.runner imports them by name). Each takes its inputs from the
context (upstream outputs come verified from the store) and writes its outputs into ctx.workdir.
"""
