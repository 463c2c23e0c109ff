"""Minimal reproducer: an ExecuTorch delegate need not take its method's inputs in order.

    python bench/repro_cuda_decode.py            # cuda if a GPU is present, else cpu

What it shows, in plain torch + ExecuTorch (no cudabuild code):
1. ExecuTorch's AOTI partitioner makes the delegate's program with its placeholders in order of
   first use in its own topological sort. For a decode step (tokens [1, 1], input_pos [1]) whose
   forward reads input_pos first, the delegate takes (input_pos, tokens) on every torch; on torch
   2.11 even tiny_lm's decode, which reads tokens first, comes out that way (its FIFO topo_sort
   puts the arange/input_pos mask before the embedding; 2.13's sort keeps the graph's order).
2. The AOTI .so compiled from that program takes its inputs in the delegate's order. Called with
   the method's order, as any tool outside ExecuTorch's runtime naturally does, it computes the
   wrong numbers without an error: both inputs hold one element. Called in the delegate's order it
   is right.

Prints one line per model: the two orders, and RIGHT/WRONG for the .so called each way.
"""

from __future__ import annotations

import copy
import ctypes
import os
import sys

import torch
from torch import nn


class ReadsPosFirst(nn.Module):
    """A decode step that reads input_pos before tokens."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(16, 8)
        self.tok = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, tokens, input_pos):  # tokens [1, 1], input_pos [1]
        where = self.pos(input_pos)
        return self.head(self.tok(tokens) + where)


class MasksAfterEmbedding(nn.Module):
    """tiny_lm's decode pattern: embed tokens first, then a causal mask from input_pos."""

    def __init__(self, S: int = 16):
        super().__init__()
        self.S = S
        self.tok = nn.Embedding(16, 8)
        self.head = nn.Linear(8, S, bias=False)

    def forward(self, tokens, input_pos):  # tokens [1, 1], input_pos [1]
        x = self.tok(tokens)  # [1, 1, 8]
        mask = torch.arange(self.S)[None, :] <= input_pos[:, None]  # [1, S]
        return self.head(x).masked_fill(~mask, 0.0)


class Capture:
    """A backend whose preprocess keeps the program ExecuTorch hands it (what CudaBackend gets)."""

    programs: list = []

    @classmethod
    def backend(cls):
        from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult

        class ReproCaptureBackend(BackendDetails):
            @staticmethod
            def preprocess(edge_program, compile_specs):
                cls.programs.append(edge_program)
                return PreprocessResult(processed_bytes=b"")

        return ReproCaptureBackend


def delegate_order(model, inputs):
    """(method's input names, the delegate's inputs as method names, the program handed over)."""
    from executorch.backends.aoti.aoti_partitioner import AotiPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    backend = Capture.backend()  # keep it alive: ExecuTorch finds backends among live subclasses
    Capture.programs.clear()
    ep = torch.export.export(model, inputs, strict=False)
    manager = to_edge_transform_and_lower(
        ep, partitioner=[AotiPartitioner(backend.__name__, [CompileSpec("method_name", b"forward")])],
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
    )
    outer = manager.exported_program()
    call = next(n for n in outer.graph.nodes if getattr(n.target, "__name__", "") == "executorch_call_delegate")
    return list(outer.graph_signature.user_inputs), [a.name for a in call.args[1:]], Capture.programs[0]


def compile_and_run(program, device: str, orders: dict[str, tuple]):
    """AOTInductor-compile the handed-over program for `device` and run it with each input order."""
    from torch.export.passes import move_to_device_pass

    program = move_to_device_pass(copy.deepcopy(program), device)
    names = set(program.graph_signature.user_inputs)
    examples = tuple(n.meta["val"] for n in program.graph.nodes if n.op == "placeholder" and n.name in names)
    options = {"aot_inductor.package": True, "aot_inductor.package_constants_in_so": False,
               "aot_inductor.package_constants_on_disk_format": "binary_blob"}
    if device == "cuda":  # ExecuTorch's CUDA options: Triton GEMMs, no libtorch
        options.update({"max_autotune": True, "max_autotune_gemm_backends": "TRITON", "aot_inductor.link_libtorch": False})
    with torch.no_grad():
        paths = torch._inductor.aot_compile(program.module(), examples, options=options)
    so = next(p for p in paths if p.endswith(".wrapper.so"))
    blob = next(p for p in paths if p.endswith(".wrapper_weights.blob"))
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ["libtorch_cpu.so"] + (["libtorch_cuda.so"] if device == "cuda" else []):
        ctypes.CDLL(os.path.join(lib, name), mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD)
    results = {}
    for label, args in orders.items():
        runner = (torch._C._aoti.AOTIModelContainerRunnerCuda(so, 1, "cuda:0") if device == "cuda"
                  else torch._C._aoti.AOTIModelContainerRunnerCpu(so, 1))
        runner.update_constant_buffer_from_blob(blob)
        results[label] = runner.run([a.to(device) for a in args])[0].cpu()
    return results


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, device {device}")
    wrong = 0
    for model in (MasksAfterEmbedding(), ReadsPosFirst()):
        torch.manual_seed(0)
        model = model.eval()
        tokens, input_pos = torch.tensor([[7]]), torch.tensor([3])
        with torch.no_grad():
            expected = model(tokens, input_pos)
        method, delegate, program = delegate_order(model, (tokens, input_pos))
        by_name = dict(zip(method, (tokens, input_pos)))
        got = compile_and_run(program, device, {"method": (tokens, input_pos),
                                                "delegate": tuple(by_name[n] for n in delegate)})
        verdict = {k: "RIGHT" if torch.allclose(v, expected, atol=1e-5) else "WRONG" for k, v in got.items()}
        wrong += verdict["method"] == "WRONG"
        print(f"{type(model).__name__}: method takes {tuple(method)}, delegate takes {tuple(delegate)}; "
              f".so called in the method's order: {verdict['method']}, in the delegate's order: {verdict['delegate']}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
