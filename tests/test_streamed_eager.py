"""cudabuild.backend.streamed_eager: a program run with only its state resident, its weights copied
per op. On the CPU the copies are forced (`copy_on_cpu`), which is how these tests watch them."""

import pytest
import torch

from cudabuild.backend.sampled_logits import program_buffers
from cudabuild.backend.streamed_eager import StreamedProgram, StreamedWriteError

LAYERS, WIDTH, ROWS = 6, 32, 8


class Stack(torch.nn.Module):
    """Six linear layers, and a cache each call writes one row of (the program's state)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.register_buffer("kv_cache", torch.zeros(ROWS, WIDTH))

    def forward(self, x, pos):  # x: [1, W], pos: [1]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        self.kv_cache.index_copy_(0, pos, x)
        return x + self.kv_cache.sum(0)


def exported():
    """A fresh program each time: its module's buffers are the program's, written by every run."""
    torch.manual_seed(0)
    return torch.export.export(Stack(), (torch.randn(1, WIDTH), torch.tensor([0])))


@pytest.fixture
def program():
    return exported()


def steps():
    torch.manual_seed(1)
    return [(torch.randn(1, WIDTH), torch.tensor([i])) for i in (0, 3, 5)]


def test_streamed_outputs_and_state_are_the_programs(program):
    plain = exported().module()
    want = [plain(*step) for step in steps()]
    streamed = StreamedProgram(program, "cpu", resident=program_buffers(program), copy_on_cpu=True)
    got = [streamed.run(step)[0] for step in steps()]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert program_buffers(program) == ["kv_cache"]
    assert torch.equal(streamed.buffers(["kv_cache"])["kv_cache"], plain.kv_cache)
    assert plain.kv_cache[[0, 3, 5]].abs().sum() > 0  # the state was written, and carried over


def test_weights_are_copied_per_op_and_let_go(program):
    streamed = StreamedProgram(program, "cpu", resident=program_buffers(program), copy_on_cpu=True)
    for step in steps():
        streamed.run(step)
    weights = sum(t.untyped_storage().nbytes() for fqn, t in program.state_dict.items() if fqn != "kv_cache")
    layer = (WIDTH * WIDTH + WIDTH) * 4
    assert streamed.copied_bytes == len(steps()) * weights  # every weight, once a call
    assert streamed.largest_op_bytes == layer  # a linear's weight and bias
    # What was alive at once: at most one layer's copies (its weight until the op that reads it
    # ends), not the whole stack: a device would hold one layer, not six.
    assert 0 < streamed.peak_live_bytes <= layer < weights / 2


def test_the_state_the_graph_writes_is_resident_though_not_named(program):
    """A program whose signature names none of its state (torch 2.11 named only part of the cuda
    Qwen3.5-MoE's, 2026-12-07): the graph's own in-place writes make it resident all the same."""
    plain = exported().module()
    want = [plain(*step) for step in steps()]
    streamed = StreamedProgram(program, "cpu", resident=(), copy_on_cpu=True)
    got = [streamed.run(step)[0] for step in steps()]
    assert streamed.resident == ["kv_cache"]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(streamed.buffers(["kv_cache"])["kv_cache"], plain.kv_cache)


def test_a_write_to_a_streamed_tensor_is_refused_not_lost(program):
    streamed = StreamedProgram(program, "cpu", copy_on_cpu=True)
    # A write the graph's scan cannot see (an op whose schema hides it) reaches a streamed copy:
    # the cache is made streamed by hand, as such an op would leave it.
    cache = streamed.gm.kv_cache
    streamed.streamed[id(cache)] = cache
    with pytest.raises(StreamedWriteError, match="writes its argument"):
        streamed.run(steps()[0])
