"""verify for a method that samples its output token inside the program: logits, not draws.

ExecuTorch's CUDA Qwen3.5-MoE returns a token drawn by a Gumbel-max sampler at a runtime
temperature, so comparing one compiled draw with one eager draw proves nothing (two right
programs disagree; a wrong one agrees by chance). Instead, the method's verify steps (stored by
export: a runner's first calls, from position 0) run one after another, at the greedy
temperature, on the eager program and on the compiled .so, each keeping its state between steps:
- every step: the token the compiled code chose must have, among the eager program's own logits
  (the tensor its sampler divides by the temperature), a logit within the tolerance of the
  largest. The eager side reports its argmax and the compiled token's rank too.
- after the last step: every buffer of the program, among them those it mutates (KV caches, conv
  and recurrent states: each layer's whole computation), must match the eager program's, within
  the tolerance.
"""

from __future__ import annotations

from typing import Any

import torch


def _float_kinds(node) -> bool:
    return node.op == "call_function" and "div" in str(node.target)


def logits_node(gm: torch.fx.GraphModule, temperature_input: int) -> torch.fx.Node:
    """The node the sampler divides by the (clamped) temperature: the logits."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    temperature = placeholders[temperature_input]
    reached, frontier = {temperature}, [temperature]
    for _ in range(4):  # temperature -> clamp -> (a view or cast) -> div(logits, t)
        nxt = []
        for node in frontier:
            for user in node.users:
                if _float_kinds(user) and len(user.args) == 2 and user.args[1] in reached:
                    first = user.args[0]
                    if isinstance(first, torch.fx.Node):
                        return first
                reached.add(user)
                nxt.append(user)
        frontier = nxt
    raise ValueError("the program has no division of logits by its temperature input: not a sampling method")


class _Capturing(torch.fx.Interpreter):
    def __init__(self, gm, target):
        super().__init__(gm)
        self.target, self.captured = target, None

    def run_node(self, n):
        out = super().run_node(n)
        if n is self.target:
            self.captured = out.detach().float().cpu()
        return out


def program_buffers(ep) -> list[str]:
    """Every buffer the program takes (an exported program keeps its state updates as in-place
    ops, so which of them a method mutates shows only after functionalization; comparing them
    all costs little, and the ones left alone compare equal)."""
    from torch.export.graph_signature import InputKind

    return sorted({s.target for s in ep.graph_signature.input_specs if s.kind == InputKind.BUFFER and s.target})


def eager_steps(ep, steps: list, device: str, temperature_input: int) -> tuple[list, dict]:
    """([(token, logits)] per step, {buffer: its value after the last step}) of the exported
    program run eagerly on `device`, its state kept between steps."""
    from torch.export.passes import move_to_device_pass

    if device != "cpu":
        ep = move_to_device_pass(ep, device)
    names = program_buffers(ep)
    gm = ep.module()
    target = logits_node(gm, temperature_input)
    results = []
    with torch.no_grad():
        for step in steps:
            interpreter = _Capturing(gm, target)
            out = interpreter.run(*[t.to(device) for t in step])
            token = (out[0] if isinstance(out, (list, tuple)) else out).detach().cpu()
            results.append((token, interpreter.captured))
    buffers = dict(gm.named_buffers())
    return results, {fqn: buffers[fqn].detach().cpu() for fqn in names if fqn in buffers}


def compiled_steps(runner, steps: list, device: str, buffers: list[str]) -> tuple[list, dict]:
    """([token] per step, {buffer: its value after the last step}) of the compiled .so."""
    tokens = []
    for step in steps:
        out = runner.run([t.to(device) for t in step])
        tokens.append(out[0].detach().cpu())
    constants = runner.extract_constants_map(False)
    return tokens, {fqn: constants[fqn].detach().cpu() for fqn in buffers if fqn in constants}


def judge(eager: list, compiled: list, eager_states: dict, compiled_states: dict, tolerance: float) -> dict:
    """The report: per step the eager argmax, the compiled token, how far its logit is below the
    largest (allowed: `tolerance` times the logits' largest magnitude), its rank; per
    buffer the largest difference (allowed: `tolerance` times max(1, its largest magnitude))."""
    report: dict[str, Any] = {"steps": [], "states": [], "passed": True}
    for i, ((_, logits), token) in enumerate(zip(eager, compiled)):
        row = logits.reshape(-1)
        chosen = int(token.reshape(-1)[0].item())
        best = float(row.max())
        gap = best - float(row[chosen]) if 0 <= chosen < row.numel() else float("inf")
        allowed = tolerance * float(row.abs().max())
        ok = gap <= allowed
        report["steps"].append({"step": i, "eager_argmax": int(row.argmax()), "compiled_token": chosen,
                                "logit_gap": gap, "allowed": allowed, "rank": int((row > row[chosen]).sum()) if gap != float("inf") else None,
                                "ok": ok})
        report["passed"] &= ok
    if len(compiled) != len(eager):
        report["passed"] = False
    for fqn, want in sorted(eager_states.items()):
        got = compiled_states.get(fqn)
        if got is None:
            continue
        diff = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
        allowed = tolerance * max(1.0, want.abs().max().item() if want.numel() else 0.0)
        ok = got.shape == want.shape and diff <= allowed
        report["states"].append({"buffer": fqn, "max_abs_diff": diff, "allowed": allowed, "ok": ok})
        report["passed"] &= ok
    report["states_compared"] = f"{len(report['states'])} of {len(eager_states)}"
    return report
