"""cudabuild's doit entry point. The graph and its logic live in the cudabuild package.

    doit export model=qwen_moe                 # the whole pipeline, target=auto
    doit export model=tiny_lm target=cpu max_autotune=ON decode.low_memory_mode=ON
    doit list --all                             # every stage of the selected build
    doit -n 4 nightly models=tiny_lm,qwen_moe targets=cpu,cuda   # many builds, build/nightly.json
"""

from cudabuild.doit_tasks import DoitRun

# This run of doit: its command line, as doit reads it, and what its tasks share. doit reads
# DOIT_CONFIG right after importing this file, and creates the tasks (task_*) later.
RUN = DoitRun()
# doit opens .doit.db right after importing this file, before it creates any task: check it first.
RUN.recover_doit_db()
# Ctrl-C: one line, the build's processes ended, exit 130 (not doit's traceback).
RUN.handle_interrupts()

DOIT_CONFIG = RUN.doit_config()
task_export = RUN.task_export
task_nightly = RUN.task_nightly
