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

Where the reference carries an fp32 truth (cudabuild.models.qwen35_moe_fp32: the same steps in fp32
on the same weights, and the largest distance from it of several bf16 runs, the eager program's
among them), the compiled program is judged against the truth instead: each step's token must be
within the tolerance of the truth's best logit, or no further below it than MARGIN times the
furthest bf16 run's choice, or than twice the bf16 runs' largest logit deviation from the truth
(the most a program whose logits are that close can give up: `_allowed_gap`); each state the truth
has must be within the tolerance of it, or no
further from it than MARGIN times the furthest bf16 run. Why: at the real shapes of a 256-expert
MoE, bf16 routing is chaotic, and two right programs differ by whole experts' shares (the module
docstring there has the numbers). A program that is wrong lies far outside what bf16 does: the
reference stage's scrambled delta rule (2026-12-06) put layer 0's recurrent state 139 times as far
from the truth as any bf16 run, and its first token 1.46 below the truth's best.
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


def program_buffers(ep) -> list[str]:
    """The buffers the program writes: its state (KV caches, conv and recurrent states), what
    verify compares after the last step. Not the others: in ExecuTorch's CUDA Qwen3.5-MoE the int4
    experts' weights and scales are buffers too, 17 GB at 40 layers, which a reference would store
    and compare with themselves.

    An exported program (torch.export's training IR) keeps its state updates as in-place ops, so
    its signature's `buffers_to_mutate` is empty until it is functionalized: a buffer is written
    where an op's schema says it writes an argument (`Tensor(a!)`) that is, or is a view of, the
    buffer's placeholder. Both are read, as a program may hold both kinds: a program whose
    signature named only some of its state would leave the rest to be streamed, and the reference
    refuses (rightly) to write a streamed copy (torch 2.11 on the GPU machine, 2026-12-07: the
    tiny cuda build's `conv_state[:B].mul_(keep)`)."""
    from torch.export.graph_signature import InputKind

    sig = ep.graph_signature
    buffers = {s.arg.name: s.target for s in sig.input_specs if s.kind == InputKind.BUFFER and s.target}
    from cudabuild.backend.streamed_eager import written_roots

    written = set(sig.buffers_to_mutate.values())
    written.update(buffers[root.name] for root in written_roots(ep.graph) if root.name in buffers)
    return sorted(written)


def eager_steps(ep, steps: list, device: str, temperature_input: int) -> tuple[list, dict]:
    """([(token, logits)] per step, {buffer: its value after the last step}) of the exported
    program run eagerly on `device`, its state kept between steps. Only the state lives on the
    device throughout; the weights are copied there op by op (cudabuild.backend.streamed_eager)."""
    from cudabuild.backend.streamed_eager import StreamedProgram

    names = program_buffers(ep)
    program = StreamedProgram(ep, device, resident=names)
    target = logits_node(program.gm, temperature_input)
    results = []
    for step in steps:
        out, logits = program.run(tuple(step), capture=target)
        token = (out[0] if isinstance(out, (list, tuple)) else out).detach().cpu()
        results.append((token, logits))
    return results, program.buffers(names)


def compiled_steps(runner, steps: list, device: str, buffers: list[str]) -> tuple[list, dict]:
    """([token] per step, {buffer: its value after the last step}) of the compiled .so."""
    tokens = []
    for step in steps:
        out = runner.run([t.to(device) for t in step])
        tokens.append(out[0].detach().cpu())
    constants = runner.extract_constants_map(False)
    return tokens, {fqn: constants[fqn].detach().cpu() for fqn in buffers if fqn in constants}


# How much further from the fp32 truth than the furthest bf16 run a compiled program may lie. The
# bf16 runs' own spread around each other is of that order (2026-12-06, H200, 35b-a3b layers=4:
# the compiled decode's layer-3 KV cache lay 1.21 times as far from the truth as the eager
# program's, as far as the plain-bf16 run's); a wrong program lies orders of magnitude further.
MARGIN = 1.5


def _gap(logits, chosen: int) -> float:
    row = logits.reshape(-1)
    return float(row.max()) - float(row[chosen]) if 0 <= chosen < row.numel() else float("inf")


def judge(eager: list, compiled: list, eager_states: dict, compiled_states: dict, tolerance: float,
          truth: dict | None = None) -> dict:
    """The report: per step the eager argmax, the compiled token, how far its logit is below the
    largest (allowed: `tolerance` times the logits' largest magnitude), its rank; per
    buffer the largest difference (allowed: `tolerance` times max(1, its largest magnitude)).
    With `truth` (see the module docstring), steps and the states it holds are judged against it."""
    report: dict[str, Any] = {"steps": [], "states": [], "passed": True, "judged_by": "truth" if truth else "eager"}
    for i, ((_, logits), token) in enumerate(zip(eager, compiled)):
        row = logits.reshape(-1)
        chosen = int(token.reshape(-1)[0].item())
        gap = _gap(row, chosen)
        entry = {"step": i, "eager_argmax": int(row.argmax()), "compiled_token": chosen, "logit_gap": gap,
                 "rank": int((row > row[chosen]).sum()) if gap != float("inf") else None}
        if truth:
            best = truth["truth"]["logits"][i].reshape(-1)
            entry.update(truth_argmax=int(best.argmax()), truth_gap=_gap(best, chosen),
                         bf16_truth_gap=truth["envelope"]["gaps"][i], allowed=_allowed_gap(truth, i, tolerance))
            if truth["envelope"].get("deviations"):
                entry["bf16_logit_deviation"] = truth["envelope"]["deviations"][i]
            entry["ok"] = entry["truth_gap"] <= entry["allowed"]
        else:
            entry["allowed"] = tolerance * float(row.abs().max())
            entry["ok"] = gap <= entry["allowed"]
        report["steps"].append(entry)
        report["passed"] &= entry["ok"]
    if len(compiled) != len(eager):
        report["passed"] = False
    truth_states = truth["truth"]["states"] if truth else {}
    for fqn, want in sorted(eager_states.items()):
        got = compiled_states.get(fqn)
        if got is None:
            continue
        diff = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
        entry = {"buffer": fqn, "max_abs_diff": diff}
        if fqn in truth_states:
            exact = truth_states[fqn].float()
            bf16 = truth["envelope"]["states"].get(fqn, 0.0)
            from_truth = (got.float() - exact).abs().max().item() if exact.numel() else 0.0
            entry.update(truth_diff=from_truth, bf16_truth_diff=bf16,
                         allowed=max(tolerance * max(1.0, exact.abs().max().item() if exact.numel() else 0.0), MARGIN * bf16))
            entry["ok"] = got.shape == exact.shape and from_truth <= entry["allowed"]
        else:
            entry["allowed"] = tolerance * max(1.0, want.abs().max().item() if want.numel() else 0.0)
            entry["ok"] = got.shape == want.shape and diff <= entry["allowed"]
        report["states"].append(entry)
        report["passed"] &= entry["ok"]
    report["states_compared"] = f"{len(report['states'])} of {len(eager_states)}"
    if truth and truth.get("eager"):
        report["reference"] = _reference_within_bf16(truth, tolerance)
        report["passed"] &= report["reference"]["ok"]
    return report


def _reference_within_bf16(truth: dict, tolerance: float) -> dict:
    """Whether the eager program itself lies where bf16 runs lie around the truth: if not, the
    reference is wrong (a kernel handed what it cannot read, say), whatever the compiled code did."""
    states, envelope = truth["truth"]["states"], truth["envelope"]["states"]
    worst = None
    for fqn, d in truth["eager"]["states"].items():
        exact = states[fqn]
        allowed = max(tolerance * max(1.0, exact.abs().max().item() if exact.numel() else 0.0), MARGIN * envelope.get(fqn, 0.0))
        if d > allowed and (worst is None or d / allowed > worst["diff"] / worst["allowed"]):
            worst = {"buffer": fqn, "diff": d, "bf16_truth_diff": envelope.get(fqn, 0.0), "allowed": allowed}
    for i, (gap, bf16) in enumerate(zip(truth["eager"]["gaps"], truth["envelope"]["gaps"])):
        allowed = _allowed_gap(truth, i, tolerance)
        if gap > allowed and worst is None:
            worst = {"buffer": f"step {i}'s token (its fp32-truth logit below the best)", "diff": gap,
                     "bf16_truth_diff": bf16, "allowed": allowed}
    return {"ok": worst is None, **({"worst": worst} if worst else {})}


def _allowed_gap(truth: dict, step: int, tolerance: float) -> float:
    """How far below the truth's best logit step `step`'s token may lie: the tolerance; MARGIN times
    the furthest bf16 run's choice; and twice the bf16 runs' largest logit deviation from the truth.
    Why the last: a program whose logits all lie within d of the truth's picks a token at most 2d
    below the truth's best (its pick gained at most d, the best lost at most d). The choices of a few
    bf16 runs sample that bound; at 8 layers of the real shapes the logits are flat enough that one
    compiled pick fell 0.83 below the truth's best where 4 bf16 runs' picks fell at most 0.31, with
    every state of the program no further from the truth than bf16's (docs/qwen_moe_cuda.md)."""
    envelope = truth["envelope"]
    allowed = max(tolerance * float(truth["truth"]["logits"][step].abs().max()), MARGIN * envelope["gaps"][step])
    if envelope.get("deviations"):
        allowed = max(allowed, 2 * envelope["deviations"][step])
    return allowed
