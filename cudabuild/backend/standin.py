"""Stand-in programs for packaging: a method's calling convention, without its graph or weights.

Once every op, constant and mutated buffer of a method is delegated to AOTI, what ExecuTorch
writes into the .pte for that method is only its outer program: the user inputs, one delegate
call taking them in order, and the user outputs (dtypes, shapes and the ranges of their dynamic
dims, which memory planning reads). The delegate's payload comes from the compile stage. So the
package stage can lower a stand-in instead of the exported program: a module with the same inputs
and outputs whose body is a few ops, which ExecuTorch lowers in a second instead of re-running
edge passes over the whole model and loading every weight (32 s of a qwen_moe package).
The .pte is byte-identical to lowering the real program (tests/test_package.py).

The signature is read from the export stage's graph summary (graph.json), which has every
placeholder's and output's tensor metadata and the symbols' ranges. Anything the stand-in cannot
reproduce exactly raises `Unsupported`, and the caller lowers the real program instead: a
non-tensor input or output, a non-contiguous input, an input the graph never reads (the real
delegate would not take it), an output dim that is not a sum of products of input dims.
"""

from __future__ import annotations

import json
import operator
import re
from dataclasses import dataclass
from functools import reduce
from typing import Any

import sympy
import torch


class Unsupported(Exception):
    """The method's calling convention is one the stand-in does not reproduce exactly."""


@dataclass(frozen=True)
class TensorSig:
    dtype: torch.dtype
    shape: tuple[sympy.Expr, ...]


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    ranges: dict[sympy.Symbol, tuple[int, int]]  # each symbol of the dims -> (min, max)


_RANGE = re.compile(r"^(\w+):VR\[(-?\d+), (-?\d+)\]$")


def _expr(text: str, symbols: dict[str, sympy.Symbol]) -> sympy.Expr:
    if re.fullmatch(r"-?\d+", text):
        return sympy.Integer(int(text))
    try:  # only the range symbols are names here: nothing of sympy's own vocabulary
        expr = sympy.sympify(text, locals=dict(symbols), rational=True)
    except (sympy.SympifyError, TypeError, SyntaxError) as e:
        raise Unsupported(f"dim {text!r} is not an expression of the input dims") from e
    if not isinstance(expr, sympy.Expr) or not expr.free_symbols <= set(symbols.values()):
        raise Unsupported(f"dim {text!r} names a symbol with no range")
    return expr


def _tensor(meta: Any, what: str, symbols: dict[str, sympy.Symbol]) -> TensorSig:
    if not (isinstance(meta, list) and len(meta) == 5 and meta[0] == "T"):
        raise Unsupported(f"{what} is not a tensor")
    _, dtype, shape, stride, _device = meta
    dims = tuple(_expr(d, symbols) for d in shape)
    contiguous = [reduce(operator.mul, dims[i + 1:], sympy.Integer(1)) for i in range(len(dims))]
    strides = [_expr(s, symbols) for s in stride]
    if any(sympy.simplify(a - b) != 0 for a, b, size in zip(strides, contiguous, dims) if size != 1):
        raise Unsupported(f"{what} is not contiguous")
    resolved = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise Unsupported(f"{what} has dtype {dtype}")
    return TensorSig(resolved, dims)


def signature(summary: dict) -> Signature:
    """The user inputs and outputs of an exported program, from its graph summary."""
    ranges, symbols = {}, {}
    for text in summary["ranges"]:
        match = _RANGE.match(text)
        if not match:
            raise Unsupported(f"range {text!r}")
        symbols[match.group(1)] = symbol = sympy.Symbol(match.group(1), integer=True, positive=True)
        ranges[symbol] = (int(match.group(2)), int(match.group(3)))
    nodes = [json.loads(line) for line in summary["nodes"]]
    placeholders = [i for i, node in enumerate(nodes) if node[0] == "placeholder"]
    if len(placeholders) != len(summary["inputs"]) or nodes[-1][0] != "output":
        raise Unsupported("graph summary and signature disagree")
    read = {ref[1] for node in nodes for ref in _refs(node[2:4])}
    inputs = []
    for index, (kind, _target) in zip(placeholders, summary["inputs"]):
        if kind != "InputKind.USER_INPUT":
            continue
        if index not in read:
            raise Unsupported(f"input {len(inputs)} is never read")
        inputs.append(_tensor(nodes[index][4], f"input {len(inputs)}", symbols))
    returned = nodes[-1][2][0]
    if len(returned) != len(summary["outputs"]):
        raise Unsupported("graph summary and signature disagree")
    outputs = [
        _tensor(nodes[ref[1]][4] if _is_ref(ref) else None, f"output {i}", symbols)
        for i, (ref, (kind, _)) in enumerate(zip(returned, summary["outputs"])) if kind == "OutputKind.USER_OUTPUT"
    ]
    return Signature(tuple(inputs), tuple(outputs), ranges)


def _is_ref(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and value[0] == "%" and isinstance(value[1], int)


def _refs(value: Any):
    if _is_ref(value):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _refs(item)


def _evaluate(expr: sympy.Expr, sizes: dict[sympy.Symbol, Any]) -> Any:
    """expr with each symbol replaced by an input's (symbolic) size, in torch's own integer ops."""
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return sizes[expr]
    if expr.is_Add:
        return reduce(operator.add, (_evaluate(a, sizes) for a in expr.args))
    if expr.is_Mul:
        return reduce(operator.mul, (_evaluate(a, sizes) for a in expr.args))
    raise Unsupported(f"output dim {expr} is not a sum of products of input dims")


class _StandIn(torch.nn.Module):
    """Reads every input (so the delegate takes them all, in order) and returns zeros shaped like
    the real outputs. Lowered, never run: the delegate it becomes carries the real compiled code."""

    def __init__(self, sig: Signature, where: dict[sympy.Symbol, tuple[int, int]]):
        super().__init__()
        self.sig, self.where = sig, where

    def forward(self, *args):
        sizes = {symbol: args[i].shape[d] for symbol, (i, d) in self.where.items()}
        anchor = sum(a.reshape(-1)[:1].to(torch.float32).sum() for a in args)
        outs = []
        for out in self.sig.outputs:
            size = [_evaluate(d, sizes) for d in out.shape]
            outs.append((torch.zeros(size, dtype=torch.float32) + anchor).to(out.dtype))
        return outs[0] if len(outs) == 1 else tuple(outs)


def stand_in_program(summary: dict):
    """An ExportedProgram with the calling convention of the program `summary` describes."""
    sig = signature(summary)
    if not sig.inputs or not sig.outputs:
        raise Unsupported("no user inputs or no user outputs")
    dims = {symbol: torch.export.Dim(symbol.name, min=lo, max=hi) for symbol, (lo, hi) in sig.ranges.items()}
    # Distinct example sizes for distinct symbols, away from 0 and 1, so export neither merges
    # two symbols nor specialises one.
    ordered = sorted(sig.ranges.items(), key=lambda item: item[0].name)
    hints = {symbol: min(max(lo, 2) + k, hi) for k, (symbol, (lo, hi)) in enumerate(ordered)}
    where: dict[sympy.Symbol, tuple[int, int]] = {}
    examples, dynamic = [], []
    for i, tensor in enumerate(sig.inputs):
        size, spec = [], {}
        for d, dim in enumerate(tensor.shape):
            if dim.is_Integer:
                size.append(int(dim))
            elif dim.is_Symbol:
                size.append(hints[dim])
                spec[d] = dims[dim]
                where.setdefault(dim, (i, d))
            else:
                raise Unsupported(f"input {i} dim {d} is {dim}, not a plain symbol")
        examples.append(torch.zeros(size, dtype=tensor.dtype))
        dynamic.append(spec or None)
    for out in sig.outputs:
        for d in out.shape:
            if not d.free_symbols <= set(where):
                raise Unsupported("an output dim depends on no input dim")
            _evaluate(d, {symbol: symbol for symbol in d.free_symbols})  # refuses what forward could not build
    try:
        return torch.export.export(_StandIn(sig, where), tuple(examples), dynamic_shapes={"args": tuple(dynamic)},
                                   strict=False)
    except Exception as e:  # export's constraint solver disagrees: lower the real program
        raise Unsupported(f"the stand-in did not export ({type(e).__name__})") from e
