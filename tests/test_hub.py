"""cudabuild.hub: `checkpoint=ORG/NAME[@REV]`, resolved by huggingface_hub in the Hub's cache.

Each test gets a Hub cache of its own in a temporary HF_HOME, laid out as huggingface_hub documents
it (blobs by hash, snapshots of links to them, refs naming commits) and read back by the library's
own `scan_cache_dir` as cached snapshots; the resolution under test is the library's
(snapshot_download), in a process of its own whose environment (HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT)
the library reads as it would in a build. Nothing reaches the Hub: the builds run offline, or
against an endpoint on loopback that refuses connections.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_ok, new_project

REPO_ID = "org/tiny-qwen"
MAIN, TAGGED = "a" * 40, "b" * 40  # the commits refs/main and refs/v1 name


def hub_cache(home: Path, repo: str, snapshots: dict[str, Path], refs: dict[str, str]) -> Path:
    """In HF_HOME `home`, `repo` with a snapshot per commit (its files: those of the folder given),
    and `refs` ({ref: commit}), as huggingface_hub lays its cache out: models--ORG--NAME/blobs/<hash>,
    snapshots/<commit>/<file> a relative link to its blob, refs/<ref> the commit. Checked with the
    library's scan_cache_dir."""
    from huggingface_hub import scan_cache_dir

    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    for commit, folder in snapshots.items():
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            data = file.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()  # an LFS file's etag: its sha256
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = root / "snapshots" / commit / file.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref, commit in refs.items():
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    scanned = {r.repo_id: r for r in scan_cache_dir(home / "hub").repos}
    assert {rev.commit_hash for rev in scanned[repo].revisions} == set(snapshots)
    for rev in scanned[repo].revisions:
        assert {f.file_name for f in rev.files} == {p.name for p in snapshots[rev.commit_hash].rglob("*") if p.is_file()}
        assert rev.refs == {ref for ref, commit in refs.items() if commit == rev.commit_hash}
    return home / "hub"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two real tiny qwen_moe checkpoints (other seeds: other weights, same shapes)."""
    import _qwen35_moe_hf as qwen35_moe_hf

    root = tmp_path_factory.mktemp("checkpoints")
    return qwen35_moe_hf.save(root / "main", fused=False), qwen35_moe_hf.save(root / "v1", fused=False, seed=1)


@pytest.fixture
def home(tmp_path, checkpoints):
    """HF_HOME with org/tiny-qwen cached: main at MAIN, the tag v1 at TAGGED."""
    home = tmp_path / "hf-home"
    hub_cache(home, REPO_ID, {MAIN: checkpoints[0], TAGGED: checkpoints[1]}, {"main": MAIN, "v1": TAGGED})
    return home


def snapshot(home: Path, commit: str) -> Path:
    from huggingface_hub import scan_cache_dir

    revisions = {r.commit_hash: r for repo in scan_cache_dir(home / "hub").repos for r in repo.revisions}
    return Path(revisions[commit].snapshot_path)


def hub_env(home: Path, offline: bool = True, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(home), PYTHONPATH=str(REPO), **{k: str(v) for k, v in extra.items()})
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def python(code: str, env: dict, *args: str) -> str:
    """What `python -c CODE ARGS` prints, in a process of its own with `env`."""
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def refused_port() -> int:
    """A loopback port nothing listens on: a Hub that cannot be reached, at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- telling an id from a path --------------------------------------------------------------------


def test_an_id_is_org_slash_name_with_a_revision_and_a_path_or_folder_is_not(tmp_path, monkeypatch):
    from cudabuild import hub

    monkeypatch.chdir(tmp_path)
    assert hub.parse("Qwen/Qwen3.5-35B-A3B") == ("Qwen/Qwen3.5-35B-A3B", None)
    assert hub.parse("Qwen/Qwen3.5-35B-A3B@refs/pr/1") == ("Qwen/Qwen3.5-35B-A3B", "refs/pr/1")
    assert hub.parse(f"{REPO_ID}@{MAIN}") == (REPO_ID, MAIN)
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    for path in ("models/qwen", "/models/qwen", "./models/qwen", "~/qwen", "qwen", "a/b/c", ""):
        assert hub.parse(path) is None, path  # a folder that is there wins, as in transformers


# -- resolution, through the library ----------------------------------------------------------------


def test_an_id_and_a_revision_resolve_to_the_snapshots_scan_cache_dir_reads(home, tmp_path):
    """org/tiny-qwen is main's snapshot; @v1 the tag's, @<commit> that commit's; offline, from the
    cache alone. What was resolved is remembered in the build's cache: the next build's lookup
    imports none of huggingface_hub's download code, until a download moves the ref."""
    cache = tmp_path / "cache"
    code = f"""
import json, sys
from cudabuild import hub
from cudabuild.engine.store import Store
store = Store({str(cache)!r})
found = {{value: str(hub.resolve(value, "checkpoint=" + value, store.actions)) for value in sys.argv[1:]}}
print(json.dumps({{"found": found, "downloader": "huggingface_hub.file_download" in sys.modules}}))
"""
    values = [REPO_ID, f"{REPO_ID}@main", f"{REPO_ID}@v1", f"{REPO_ID}@{TAGGED}"]
    run = lambda: json.loads(python(code, hub_env(home), *values))  # noqa: E731
    first = run()
    assert first["found"] == {REPO_ID: str(snapshot(home, MAIN)), f"{REPO_ID}@main": str(snapshot(home, MAIN)),
                              f"{REPO_ID}@v1": str(snapshot(home, TAGGED)), f"{REPO_ID}@{TAGGED}": str(snapshot(home, TAGGED))}
    assert first["downloader"]
    again = run()
    assert again == dict(first, downloader=False)

    ref = home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "refs" / "main"
    ref.write_text(TAGGED)  # what a download of a newer main does
    moved = run()
    assert moved["found"][REPO_ID] == str(snapshot(home, TAGGED)) and moved["downloader"]


def test_an_id_and_the_folder_it_resolves_to_give_the_same_keys(home, checkpoints, project, tmp_path):
    """Every stage's key is the same whether the checkpoint is named by id, by its snapshot's path,
    or is a plain folder holding the same files: the key is the files' content. Another revision
    (other weights) gives other keys."""
    plain = tmp_path / "plain"
    shutil.copytree(checkpoints[0], plain)
    code = f"""
import json, sys
from pathlib import Path
from cudabuild.config import load_config
from cudabuild.engine.hashing import digest
from cudabuild.engine.runner import Runner
from cudabuild.engine.store import Store
store = Store({str(project.cache)!r})
keys = {{}}
for value in sys.argv[1:]:  # a fresh project: no stamps, so every stage is keyed from the options up
    config = load_config(Path({str(project.root)!r}), {{"model": "qwen_moe", "target": "cpu", "checkpoint": value}}, store)
    runner = Runner(config, store, run_id="keys")
    keys[value] = {{s.id: digest(runner.inputs(s)) for s in runner.pipeline.plan(config)}}
print(json.dumps(keys))
"""
    values = [REPO_ID, str(snapshot(home, MAIN)), str(plain), f"{REPO_ID}@v1"]
    keys = json.loads(python(code, hub_env(home), *values))
    assert keys[REPO_ID] == keys[str(snapshot(home, MAIN))] == keys[str(plain)]
    assert keys[f"{REPO_ID}@v1"]["export.decode"] != keys[REPO_ID]["export.decode"]
    assert keys[f"{REPO_ID}@v1"]["probe"] == keys[REPO_ID]["probe"]


# -- an id that is neither cached nor reachable: one line, exit 2, before any stage ----------------


@pytest.mark.parametrize("setting, offline, problem", [
    pytest.param("org/absent", True, "nor a model in the Hugging Face Hub's cache at {cache} (HF_HUB_OFFLINE is set: "
                 "nothing is downloaded); fetch it with `hf download org/absent` (or `huggingface-cli download`) where "
                 "the Hub is reachable", id="offline"),
    pytest.param(f"{REPO_ID}@v2", True, "nor a model in the Hugging Face Hub's cache at {cache} (HF_HUB_OFFLINE is set: "
                 f"nothing is downloaded); fetch it with `hf download {REPO_ID} --revision v2` (or `huggingface-cli "
                 "download`) where the Hub is reachable", id="offline-revision"),
    pytest.param("org/absent", False, "nor a model in the Hugging Face Hub's cache at {cache}, and the Hub at "
                 "{endpoint} could not be reached (", id="unreachable"),
])
def test_an_id_neither_cached_nor_reachable_is_one_line_exit_2_before_any_stage(home, project, setting, offline, problem):
    endpoint = f"http://127.0.0.1:{refused_port()}"
    env = project.env(**hub_env(home, offline=offline, HF_ENDPOINT=endpoint))
    done = project.export("model=qwen_moe", "target=cpu", f"checkpoint={setting}", env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("cudabuild: ")]
    expected = (f"cudabuild: error: qwen_moe option checkpoint={setting}: no such folder, "
                + problem.format(cache=home / "hub", endpoint=endpoint))
    assert len(lines) == 1 and lines[0].startswith(expected), (lines, expected)
    assert "Traceback" not in done.stderr
    if offline:
        assert done.stdout == ""
    else:  # it tried: said, then refused
        assert done.stdout.splitlines() == [f"  qwen_moe option checkpoint={setting}: not in the Hugging Face Hub's cache "
                                            f"at {home / 'hub'}; downloading its *.json and *.safetensors files from "
                                            f"{endpoint}"]
        assert lines[0].endswith(f"fetch it with `hf download {setting}` (or `huggingface-cli download`) where the Hub "
                                 "is reachable"), lines
    assert not (project.root / "build").exists()  # no stage ran


# -- end to end ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_build_by_path_is_up_to_date_by_id(home, tmp_path):
    """The issue's promise, end to end: a build of the snapshot's folder, then the same build named
    by its id (and by its revision's tag) runs and restores nothing."""
    project = new_project(tmp_path / "p")
    env = project.env(**hub_env(home))
    path = snapshot(home, MAIN)
    assert_ok(project.export("model=qwen_moe", "target=cpu", "layers=1", f"checkpoint={path}", env=env))
    assert set(project.statuses("qwen_moe", "cpu").values()) == {"ran"}
    for named in (REPO_ID, f"{REPO_ID}@{MAIN}"):
        done = project.export("model=qwen_moe", "target=cpu", "layers=1", f"checkpoint={named}", env=env)
        assert_ok(done)
        assert set(project.statuses("qwen_moe", "cpu").values()) == {"cached"}, done.stdout[-2000:]
    assert project.manifest("qwen_moe", "cpu")["options"]["checkpoint"] == str(path)
