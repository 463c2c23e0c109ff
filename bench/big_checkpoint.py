"""A real-size checkpoint on the CPU: qwen_moe 35b-a3b shapes, cut to a few layers, every case side
by side in one run (issue: real checkpoints at real size). Not in CI: it writes tens of GB.

    python bench/big_checkpoint.py [--layers 4] [--work DIR] [--max-seq-len 4]

The checkpoint is synthetic (bench/synthetic_checkpoint.py: the project's own writer, one shard per
layer; 4 layers are 8.6 GB of bf16). Each case is a whole `doit export model=qwen_moe target=cpu
checkpoint=...` process in a throwaway copy of the project, with its own cache; its peak RSS is
the largest process's high-water mark (wait4's ru_maxrss), and the resident and anonymous memory
(what cannot be given back to the page cache) of all its processes together (stages side by side
run in doit's workers) is sampled from /proc.

  cold     empty cache: peak RSS against the checkpoint's bytes (goal <= 1.5x)
  noop     the same again (goal < 2 s: stat fingerprints, nothing re-read)
  touch    every shard touched (new mtime, same bytes): re-hashed once, nothing reruns; then a no-op
  method   a one-method spec change (decode.low_memory_mode=ON): how much the store grows
           (goal: that method's .so and the new .pte; the weights are stored once)
  restore  rm -rf build (and doit's db), then a build: against copying the .ptd with `cp`, the
           fastest safe way to materialise it on this filesystem (goal: <= 1 s plus that)
  edit     build/.../model.ptd truncated by hand: the cache is unharmed, the next build restores it
  shard    one tensor's bytes changed in one shard: export onward reruns, and explain and the
           build name the tensor
The .ptd's bytes against the weights' (goal <= 1.05: one copy of the weights for both methods)
comes from the cold build. Results are printed and written to WORK/big_checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

GB = 1e9
CASES = ("touch", "method", "restore", "edit", "shard")


def _tree(pid: int) -> list[int]:
    """pid and its descendants (doit's worker processes, under `doit -n N`)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return found


def _status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def peak_anon_sampler(pid: int, out: dict) -> threading.Thread:
    """Every 0.2 s, sum over the process and its workers: anonymous RSS (RssAnon) into out["anon"]
    and resident memory (VmRSS) into out["tree_rss"] (bytes, max). Stages side by side are in
    several processes, and wait4's high-water mark is that of the largest one alone."""
    def sample():
        while True:
            pids = _tree(pid)
            out["anon"] = max(out.get("anon", 0), sum(_status_kb(p, "RssAnon:") for p in pids))
            out["tree_rss"] = max(out.get("tree_rss", 0), sum(_status_kb(p, "VmRSS:") for p in pids))
            if not _status_kb(pid, "VmRSS:"):  # exited (a zombie has no resident memory)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    return thread


def run(cmd: list[str], cwd: Path, env: dict) -> dict:
    """One whole process: seconds, peak RSS (its high-water mark), sampled peak anonymous RSS."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        memory: dict = {}
        sampler = peak_anon_sampler(proc.pid, memory)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.monotonic() - start
        sampler.join(timeout=1)
        log.seek(0)
        text = log.read().decode(errors="replace")
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed (rc {rc}):\n{text[-3000:]}")
    return {"seconds": round(seconds, 2), "peak_rss": usage.ru_maxrss * 1024, "peak_anon": memory.get("anon", 0),
            "tree_rss": memory.get("tree_rss", 0), "log": text}


def statuses(project: Path) -> dict[str, str]:
    manifest = json.loads((project / "build/qwen_moe/cpu/manifest.json").read_text())
    return {f"{s['stage']}.{s['method']}" if s["method"] else s["stage"]: s["status"] for s in manifest["stages"]}


def reasons(project: Path) -> dict[str, str]:
    manifest = json.loads((project / "build/qwen_moe/cpu/manifest.json").read_text())
    return {f"{s['stage']}.{s['method']}" if s["method"] else s["stage"]: s.get("reason", "") for s in manifest["stages"]}


def store_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoint, project and cache go (default: a temp dir)")
    parser.add_argument("--max-seq-len", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="keep WORK afterwards")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"which cases after cold and noop to run, in this order (default: {','.join(CASES)})")
    args = parser.parse_args()
    cases = set(args.cases.split(",")) - {""}
    if cases - set(CASES):
        parser.error(f"unknown case {sorted(cases - set(CASES))[0]}; the cases are {', '.join(CASES)}")

    sys.path.insert(0, str(ROOT))
    from cudabuild.formats.safetensors_parts import read_raw_header  # no torch: this process stays small

    work = args.work or Path(tempfile.mkdtemp(prefix="cudabuild-big-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt, project, cache = work / "checkpoint", work / "project", work / "cache"
    for path in (project, cache, work / "inductor"):
        shutil.rmtree(path, ignore_errors=True)
    results: dict = {"layers": args.layers}
    try:
        info_file = ckpt / ".bench-info.json"  # hidden: not part of the checkpoint's key
        if info_file.exists() and json.loads(info_file.read_text()).get("layers") == args.layers:
            info = json.loads(info_file.read_text())
        else:
            shutil.rmtree(ckpt, ignore_errors=True)
            # In a process of its own: a child's peak RSS (wait4) counts the memory of the process
            # it was forked from, so this one must stay small.
            subprocess.run([sys.executable, str(ROOT / "bench/synthetic_checkpoint.py"), str(ckpt), "--layers", str(args.layers),
                            "--info", str(info_file)], check=True)
            info = dict(json.loads(info_file.read_text()), layers=args.layers)
            info_file.write_text(json.dumps(info))
        weights = info["bytes"]
        results["checkpoint"] = {"bytes": weights, "shards": info["shards"], "write_seconds": round(info["seconds"], 1)}
        print(f"checkpoint: {weights / GB:.2f} GB in {info['shards']} shards ({info['seconds']:.0f} s to write)", flush=True)

        project.mkdir()
        shutil.copy(ROOT / "dodo.py", project)
        for folder in ("cudabuild", "recipes"):
            shutil.copytree(ROOT / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__"))
        env = dict(os.environ, CUDABUILD_CACHE_DIR=str(cache), CUDABUILD_PROJECT=str(project),
                   CUDABUILD_INDUCTOR_DIR=str(work / "inductor"), PYTHONPATH=str(project))
        env.pop("CUDABUILD_REMOTE", None)
        build_args = ["model=qwen_moe", "target=cpu", f"checkpoint={ckpt}", f"max_seq_len={args.max_seq_len}", f"chunk={max(1, min(16, args.max_seq_len // 2))}"]
        doit = [sys.executable, "-m", "doit", "export", *build_args]
        out_dir = project / "build/qwen_moe/cpu"

        def case(name: str, cmd=None, note: str = "") -> dict:
            r = run(cmd or doit, project, env)
            entry = {k: r[k] for k in ("seconds", "peak_rss", "peak_anon", "tree_rss")}
            if (out_dir / "manifest.json").exists():
                entry["statuses"] = statuses(project)
                manifest = json.loads((out_dir / "manifest.json").read_text())
                entry["stage_peak_rss"] = {f"{s['stage']}.{s['method']}" if s["method"] else s["stage"]: s["peak_rss"]
                                           for s in manifest["stages"] if s.get("peak_rss")}
            results[name] = entry
            ran = sorted(s for s, v in entry.get("statuses", {}).items() if v == "ran")
            print(f"{name:<8} {r['seconds']:8.2f} s  peak RSS {r['peak_rss'] / GB:6.2f} GB ({r['peak_rss'] / weights:.2f}x)"
                  f"  all processes {r['tree_rss'] / GB:6.2f} GB ({r['tree_rss'] / weights:.2f}x)"
                  f"  anon {r['peak_anon'] / GB:6.2f} GB ({r['peak_anon'] / weights:.2f}x)  ran: {', '.join(ran) or 'nothing'} {note}",
                  flush=True)
            entry["log_tail"] = r["log"][-1500:]
            return entry

        cold = case("cold")
        print("         peak RSS per stage (sampled): " + ", ".join(
            f"{stage} {peak / weights:.2f}x" for stage, peak in cold.get("stage_peak_rss", {}).items()))
        ptd = out_dir / "aoti_cpu_blob.ptd"
        results["ptd_over_weights"] = round(ptd.stat().st_size / weights, 4)
        print(f".ptd {ptd.stat().st_size / GB:.2f} GB / weights {weights / GB:.2f} GB = {results['ptd_over_weights']:.3f}")
        case("noop")

        shards = sorted(ckpt.glob("*.safetensors"))
        if "touch" in cases:
            now = time.time()
            for shard in shards:
                os.utime(shard, (now, now))
            case("touch")
            case("noop2")

        spec_change = []  # the later cases build what the last build built
        if "method" in cases:
            before = store_bytes(cache)
            spec_change = ["decode.low_memory_mode=ON"]
            method = case("method", doit + spec_change)
            print("         peak RSS per stage (sampled): " + ", ".join(
                f"{stage} {peak / weights:.2f}x" for stage, peak in method.get("stage_peak_rss", {}).items()))
            grown = store_bytes(cache) - before
            results["method"]["store_growth"] = grown
            pte = (out_dir / "model.pte").stat().st_size
            results["method"]["pte_bytes"] = pte
            print(f"         store grew {grown / 1e6:.1f} MB (the new .pte is {pte / 1e6:.1f} MB, weights {weights / GB:.2f} GB)")

        if "restore" in cases:
            # A copy of gigabytes is timed by how fast the disk takes dirty pages, and the one before it
            # may still be being written back: so each timing starts after a `sync` (and, where this
            # process may, with the page cache dropped), and the restore and `cp` of the same stored
            # blob take turns, twice; the medians are compared.
            from cudabuild.engine.store import Store

            stored = json.loads((out_dir / "manifest.json").read_text())["outputs"]["aoti_cpu_blob.ptd"]
            store_ = Store(cache)
            blob_file = store_.objects.blob_path(stored)  # what a restore copies from
            store_.close()

            def settle() -> None:
                os.sync()
                try:
                    Path("/proc/sys/vm/drop_caches").write_text("3\n")
                except OSError:
                    pass

            def restore_once() -> dict:
                shutil.rmtree(project / "build")
                for db in project.glob(".doit.db*"):
                    db.unlink()
                settle()
                return case("restore", doit + spec_change)

            def cp_once() -> float:
                with tempfile.TemporaryDirectory(dir=work) as tmp:
                    settle()
                    start = time.monotonic()
                    subprocess.run(["cp", "--reflink=auto", str(blob_file), os.path.join(tmp, "copy.ptd")], check=True)
                    return time.monotonic() - start

            rounds = [(cp_once(), restore_once()) for _ in range(2)]
            restore = rounds[-1][1]
            restore["rounds"] = [{"cp_ptd_seconds": round(c, 2), "restore_seconds": r["seconds"]} for c, r in rounds]
            copy_seconds = statistics.median(c for c, _ in rounds)
            restore_seconds = statistics.median(r["seconds"] for _, r in rounds)
            restore["cp_ptd_seconds"] = round(copy_seconds, 2)
            restore["median_seconds"] = round(restore_seconds, 2)
            print(f"         cp --reflink=auto of the .ptd: {copy_seconds:.2f} s; restore {restore_seconds:.2f} s; "
                  f"restore - cp = {restore_seconds - copy_seconds:.2f} s (medians of 2, each after a sync)")
            settle()

        if "edit" in cases:
            stored_ptd = json.loads((out_dir / "manifest.json").read_text())["outputs"]["aoti_cpu_blob.ptd"]
            with open(ptd, "r+b") as f:
                f.truncate(1000)
            edit = case("edit", doit + spec_change)
            verify = subprocess.run([sys.executable, "-m", "cudabuild", "cache", "verify"], cwd=project, env=env,
                                    capture_output=True, text=True)
            edit["cache_verify"] = (verify.stdout + verify.stderr).strip()[-300:]
            from hashlib import sha256

            h = sha256()
            with open(ptd, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
            edit["ptd_restored_intact"] = h.hexdigest() == stored_ptd
            print(f"         after truncating build's .ptd: restored intact {edit['ptd_restored_intact']}; cache verify: "
                  f"{edit['cache_verify'].splitlines()[-1] if edit['cache_verify'] else '?'}")

        if "shard" in cases:
            shard = shards[-1]
            entries, start, _ = read_raw_header(shard)
            name, entry = max(((n, e) for n, e in entries.items() if n != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
            begin = start + (entry["data_offsets"][0] + entry["data_offsets"][1]) // 2
            with open(shard, "r+b") as f:
                f.seek(begin)
                old = f.read(64)
                f.seek(begin)
                f.write(bytes(b ^ 0x01 for b in old))  # the lowest bit of 32 bf16 values: a different checkpoint
            explain = subprocess.run([sys.executable, "-m", "cudabuild", "explain", *build_args, *spec_change],
                                     cwd=project, env=env, capture_output=True, text=True)
            results["shard_explain"] = explain.stdout.strip().splitlines()[:6]
            shard_case = case("shard", doit + spec_change)
            shard_case["changed"] = {"shard": shard.name, "tensor": name}
            shard_case["export_reasons"] = {k: v for k, v in reasons(project).items() if k.startswith("export")}
            print(f"         changed tensor {name} in {shard.name}; explain says:")
            for line in results["shard_explain"]:
                print(f"           {line}")
            for stage, why in shard_case["export_reasons"].items():
                print(f"         {stage}: {why}")
    finally:
        (work / "big_checkpoint.json").write_text(json.dumps(results, indent=1))
        print(f"results: {work / 'big_checkpoint.json'}")
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
