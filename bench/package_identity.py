"""Does package's stand-in lowering give the bytes that lowering the exported programs gives?

    python bench/package_identity.py MODEL TARGET      # in a project with a finished build of MODEL/TARGET

Reads the build's stamps and the store (CUDABUILD_CACHE_DIR), lowers the real exported programs
with the same compiled .so / weights blobs through the package stage's own `write_package`, and
compares sha256 with build/MODEL/TARGET/. Prints one JSON line: identical, and both timings.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))


def main(model: str, target: str) -> int:
    from cudabuild.backend import delegate
    from cudabuild.backend.programs import load_program
    from cudabuild.backend.stages.package import write_package
    from cudabuild.engine.store import Store

    build = ROOT / "build" / model / target
    stamp = lambda stage: json.loads((build / ".stamps" / f"{stage}.json").read_text())
    package = stamp("package")
    methods = list(package["inputs"]["methods"])
    store = Store()
    output = lambda stage, name: store.objects.read_bytes(stamp(stage)["outputs"][name])
    start = time.monotonic()
    programs = {m: load_program(lambda name, m=m: output(f"export.{m}", name)) for m in methods}
    compiled = {m: delegate.Compiled(output(f"blob.{m}", "model.so"), output(f"blob.{m}", "weights.blob")) for m in methods}
    specs = {m: package["inputs"]["methods"][m]["specs"] for m in methods}
    with tempfile.TemporaryDirectory() as out:
        files = write_package(programs, compiled, specs, target, json.loads(output(f"export.{methods[0]}", "metadata.json")),
                              Path(out), model)
        sha = lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest()
        identical = {name: sha(path) == sha(build / name) for name, path in files.items()}
    print(json.dumps({"identical": all(identical.values()), "files": identical, "stand_in": package["value"],
                      "package_stage_seconds": package["seconds"], "exported_programs_seconds": round(time.monotonic() - start, 2)}))
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("target", choices=("cpu", "cuda"))
    args = parser.parse_args()
    sys.exit(main(args.model, args.target))
