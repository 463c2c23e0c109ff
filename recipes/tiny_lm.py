"""tiny_lm: a two-layer decoder with a KV cache, small enough to lower in seconds on 2 CPU cores.

    doit export model=tiny_lm               # target=auto: cuda when a GPU is present, else cpu
    doit export model=tiny_lm target=cpu max_autotune=ON

The model (cudabuild/models/tiny_lm.py) gets random weights from a fixed seed (option `seed`;
another seed is new weights for the same code: `doit export model=tiny_lm seed=1` writes a new
weights blob and compiles nothing). Two methods: `decode` (one token) and `prefill` (T tokens,
T symbolic). `layers` (default 2) is the number of decoder blocks: another is other code.
"""

from __future__ import annotations

import torch

from cudabuild.models.tiny_lm import TinyConfig, TinyLM
from cudabuild.options import Option
from cudabuild.recipe import Method, Recipe


def build(options) -> TinyLM:
    torch.manual_seed(options.seed)
    return TinyLM(TinyConfig(n_layers=options.layers)).eval()


def decode_inputs(model: TinyLM):
    return (torch.tensor([[7]], dtype=torch.long), torch.tensor([3], dtype=torch.long))


def prefill_inputs(model: TinyLM):
    T = 8
    return (torch.arange(T, dtype=torch.long)[None, :] % model.cfg.vocab_size, torch.arange(T, dtype=torch.long))


def prefill_shapes(model: TinyLM):
    T = torch.export.Dim("T", min=2, max=model.cfg.max_seq_len - 1)
    return ({1: T}, {0: T})


def metadata(model: TinyLM):
    return {
        "get_max_seq_len": model.cfg.max_seq_len,
        "get_vocab_size": model.cfg.vocab_size,
        "get_n_layers": model.cfg.n_layers,
        "use_kv_cache": True,
    }


RECIPE = Recipe(
    build=build,
    methods=(
        Method("decode", inputs=decode_inputs),
        Method("prefill", inputs=prefill_inputs, dynamic_shapes=prefill_shapes),
    ),
    options=(Option("seed", 0, minimum=0, values_only=True,
                    help="the random weights' seed: another is new weights for the same code"),
             Option("layers", 2, minimum=1, help="decoder blocks: another count is other code")),
    specs={
        # Tuning by benchmark buys nothing for a model this small on a CPU; keep builds quick.
        "cpu": {"max_autotune": "OFF"},
        "cuda": {"triton_kernel_mode": "OFF"},
    },
    constant_methods=metadata,
)
