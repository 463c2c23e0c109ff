"""A checkpoint named by its Hugging Face Hub id, resolved to its snapshot folder in the Hub's cache.

    doit export model=qwen_moe checkpoint=Qwen/Qwen3.5-35B-A3B            # the cached snapshot of main
    doit export model=qwen_moe checkpoint=Qwen/Qwen3.5-35B-A3B@v1.0       # a branch, tag or commit

transformers, vLLM and optimum-executorch take a model by its id, and the people who build it have
it in the Hub's cache. An option that takes one (options.Option `hub`) is given `ORG/NAME[@REV]`
that is not a path on this machine; huggingface_hub resolves it (snapshot_download): the local
cache first (`local_files_only`), which is all that HF_HUB_OFFLINE allows; else, where the Hub
answers, the checkpoint's files (PATTERNS) are downloaded into that cache, as transformers does.
The build then holds the snapshot's folder, and keys its files by content (cudabuild.pipeline), so
one snapshot gives the same keys whether it is named by id or by its folder. An id neither cached
nor reachable is refused in one line that names it and the command that fetches it.

A no-op build stays cheap: huggingface_hub's download code takes about 0.4 s to import, so what it
resolved is remembered in the cache (a `hub:` document) with the stat of the revision's ref in the
Hub's cache (`refs/<rev>`, which a download of a newer commit rewrites), and the library is asked
again only when that changed or the snapshot is gone.

Owns telling an id from a path and resolving it. Must not touch: what the checkpoint holds (the
recipe checks that, in the folder this gives).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from cudabuild.errors import CudabuildError

# ORG/NAME, then @REV (a branch, a tag, a commit; a branch may hold "/", as refs/pr/1 does).
_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>\S+))?$")
# What a checkpoint is made of (config.json, the index, the shards); a download fetches these only.
PATTERNS = ["*.json", "*.safetensors"]


class HubCheckpointUnavailable(CudabuildError):
    """A Hub id that cannot be resolved here: not cached, and not downloadable now."""


def parse(value: str) -> Optional[tuple[str, Optional[str]]]:
    """(repo id, revision or None) when `value` names a Hub model rather than a folder: ORG/NAME or
    ORG/NAME@REV, and no path of that name on this machine (a folder wins, as in transformers)."""
    text = str(value).strip()
    if not text or text.startswith(("/", "~", ".")) or os.path.exists(text):
        return None
    match = _ID.match(text)
    return (match["repo"], match["rev"]) if match else None


def fetch_command(repo: str, revision: Optional[str]) -> str:
    return f"hf download {repo}" + (f" --revision {revision}" if revision else "")


def resolve(value: str, what: str, memo=None) -> Path:
    """The snapshot folder `value` (an id: `parse`) names in the Hub's cache, downloaded there first
    where it is not and the Hub answers; HubCheckpointUnavailable (`what`: the setting, as the
    user wrote it) where it is neither. `memo` (the cache's ActionCache: a document of it) remembers it for the next build."""
    repo, revision = parse(value)
    try:
        from huggingface_hub import constants  # the library's settings alone: cheap
    except ImportError:
        raise HubCheckpointUnavailable(what, "no such folder; a Hugging Face Hub id needs huggingface_hub",
                                       fix="pip install huggingface_hub (scripts/bootstrap.sh installs it)") from None
    cache, ref_name = constants.HF_HUB_CACHE, revision or constants.DEFAULT_REVISION
    name = f"hub:{cache}:{repo}@{ref_name}"
    remembered = memo.get_json(name) if memo is not None else None
    if (remembered and remembered.get("ref") == _ref_signature(cache, repo, ref_name)
            and Path(remembered.get("snapshot", "")).is_dir()):
        return Path(remembered["snapshot"])
    snapshot = Path(_snapshot(repo, revision, what, cache, constants))
    if memo is not None:
        memo.put_json(name, {"snapshot": str(snapshot), "ref": _ref_signature(cache, repo, ref_name)})
    return snapshot


def _ref_signature(cache: str, repo: str, revision: str) -> Optional[list]:
    """The stat of the ref file the Hub's cache keeps for a branch or tag (its layout:
    models--ORG--NAME/refs/<rev>), or None (a commit's snapshot has none, and never changes)."""
    try:
        st = os.stat(os.path.join(cache, "models--" + repo.replace("/", "--"), "refs", revision))
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _snapshot(repo: str, revision: Optional[str], what: str, cache: str, constants) -> str:
    """huggingface_hub's snapshot_download: the cache first, then (unless offline) the Hub."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    fetch = f"fetch it with `{fetch_command(repo, revision)}` (or `huggingface-cli download`) where the Hub is reachable"
    try:
        return snapshot_download(repo, revision=revision, local_files_only=True, allow_patterns=PATTERNS)
    except HFValidationError as e:
        raise HubCheckpointUnavailable(what, f"no such folder, nor a Hugging Face Hub id ({_first_line(e)})",
                                       expected="a folder, or ORG/NAME[@REVISION]") from None
    except LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            held = (f"and the Hugging Face Hub's cache at {cache} holds it only in part"
                    if type(e).__name__ == "IncompleteSnapshotError" else f"nor a model in the Hugging Face Hub's cache at {cache}")
            raise HubCheckpointUnavailable(what, f"no such folder, {held} (HF_HUB_OFFLINE is set: nothing is downloaded)",
                                           fix=fetch) from None
    from cudabuild.engine.console import terminal

    terminal.note(f"{what}: not in the Hugging Face Hub's cache at {cache}; downloading its "
                  f"{' and '.join(PATTERNS)} files from {constants.ENDPOINT}")
    try:
        return snapshot_download(repo, revision=revision, allow_patterns=PATTERNS)
    except RevisionNotFoundError:
        raise HubCheckpointUnavailable(what, f"the Hugging Face Hub's {repo} has no revision {revision}",
                                       fix="name one of its branches, tags or commits") from None
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise HubCheckpointUnavailable(
            what, f"no such folder, and the Hugging Face Hub has no model {repo} that this machine may read "
                  f"({type(e).__name__})",
            fix="check the id; for a gated or private model, log in (`hf auth login`) and accept its terms on the Hub"
        ) from None
    except LocalEntryNotFoundError as e:
        cause = e.__cause__ or e
        raise HubCheckpointUnavailable(
            what, f"no such folder, nor a model in the Hugging Face Hub's cache at {cache}, and the Hub at "
                  f"{constants.ENDPOINT} could not be reached ({type(cause).__name__}: {_first_line(cause)})",
            fix=fetch) from None
    except Exception as e:  # a download cut short, a full disk, a server error mid-way
        raise HubCheckpointUnavailable(what, f"its download from the Hugging Face Hub failed ({type(e).__name__}: "
                                             f"{_first_line(e)})", fix=fetch) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
