#!/usr/bin/env bash
# On the CPU machine, in the project's root: what a device call carries, in git-ignored folders.
#   .whl   the cp312 wheels the GPU machine lacks (../shared/gpu-kit/fetch-wheels.sh: executorch,
#          torchao, fla, doit, diskcache, boto3, redis, ...)
#   .etrt  ExecuTorch's C++ CUDA runtime (../shared/et-runtime), which does not travel by itself
# Then: run(command="bash bench/gpu/session.sh CASE...", carry=[".whl", ".etrt"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
for ignored in /.whl/ /.etrt/; do
  grep -qx "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
[ -n "$(ls .whl/executorch-*.whl 2>/dev/null)" ] || bash ../shared/gpu-kit/fetch-wheels.sh
[ -x .etrt/run.sh ] || cp -r ../shared/et-runtime .etrt
du -sh .whl .etrt
