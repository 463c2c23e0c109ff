"""cudabuild's doit entry point. The graph and its logic live in the cudabuild package.

    doit export model=qwen_moe                 # the whole pipeline, target=auto
    doit export model=tiny_lm target=cpu max_autotune=ON decode.low_memory_mode=ON
    doit list --all                             # every stage of the selected build
    doit -n 4 nightly models=tiny_lm,qwen_moe targets=cpu,cuda   # many builds, build/nightly.json
"""

from cudabuild.doit_tasks import DOIT_CONFIG, task_export, task_nightly  # noqa: F401
from cudabuild.doit_tasks import handle_interrupts, recover_doit_db

# doit opens .doit.db right after importing this file, before it creates any task: check it first.
recover_doit_db()
# Ctrl-C: one line, the build's processes ended, exit 130 (not doit's traceback).
handle_interrupts()
