"""Why a stage's key changed: the differences between two stage-input dicts, in words.

`changes(old, new)` walks both JSON trees and names each leaf that differs, with the path
(`specs.max_autotune: OFF -> ON`, `toolchain.triton: 3.6.0 -> 3.7.1`, `sources.recipes/x.py
changed`). It is pure data work: no torch, no store access.
"""

from __future__ import annotations

from typing import Any

_HASHY = ("sources", "checkpoint", "graph", "compiled")


def _short(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64:
        return value[:12]
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def changes(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in old:
                out.append(f"{sub} added ({_short(new[key])})" if not path.startswith(_HASHY) else f"{sub} added")
            elif key not in new:
                out.append(f"{sub} removed")
            else:
                out.extend(changes(old[key], new[key], sub))
        return out
    if old == new:
        return []
    root = path.split(".", 1)[0]
    if root in ("sources", "checkpoint"):
        return [f"{path} changed"]
    if root in ("graph", "compiled") or path.endswith((".graph", ".compiled")):
        return [f"{path} changed ({_short(old)} -> {_short(new)})"]
    return [f"{path}: {_short(old)} -> {_short(new)}"]


def reason(old_inputs: dict | None, new_inputs: dict) -> str:
    """One line: why a stage with these inputs must run, given the inputs it last ran with."""
    if old_inputs is None:
        return "not built here before, and no cached result"
    found = changes(old_inputs, new_inputs)
    if not found:
        return "outputs missing from build/ and from the cache"
    return "; ".join(found[:4]) + (f"; and {len(found) - 4} more" if len(found) > 4 else "")
