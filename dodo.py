"""cudabuild's doit entry point. The graph and its logic live in the cudabuild package.

    doit export model=qwen_moe                 # the whole pipeline, target=auto
    doit export model=tiny_lm target=cpu max_autotune=ON decode.low_memory_mode=ON
    doit list --all                             # every stage of the selected build
"""

from cudabuild.doit_tasks import DOIT_CONFIG, task_export  # noqa: F401
