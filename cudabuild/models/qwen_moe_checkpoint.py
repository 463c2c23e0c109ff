"""What a Qwen3.5-MoE Hugging Face checkpoint must hold, as data, and its check before any stage runs.

Owns the table of config.json's fields that qwen_moe reads: both of its forms are ExecuTorch's
model (`Qwen35MoEConfig.from_hf_config` and its lazy checkpoint reader; the CPU form transformed,
cudabuild/models/qwen35_moe_plain.py), so one table serves both: each field's type, range or
choices (ExecuTorch's model has no rope scaling and only silu), whether it must be there and its
default. From the checked fields it derives the tensors the checkpoint must hold (names, shapes,
dtypes) and compares them with the safetensors headers, reading no tensor data.

`check_checkpoint(folder, layers)` collects every problem, one line each, naming the file and the
field or tensor. Must not touch torch, the model classes or tensor data: this runs in the build's
first second, from the recipe's `resolve` (memoised by the headers' digests, see
cudabuild.registry).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from cudabuild.formats.safetensors_parts import HeaderError, checked_header
from cudabuild.models.qwen35_moe_sizes import kept_layers

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# What ExecuTorch's model implements: SwiGLU experts, rotary embedding without scaling.
ACTIVATIONS = ("silu",)
ROPE_TYPES = ("default",)
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}  # config dtype -> safetensors code
LAYER_KINDS = ("full_attention", "linear_attention")
# Qwen3.5 rotates a quarter of each head; its configs may leave partial_rotary_factor out.
DEFAULT_PARTIAL_ROTARY = 0.25
# A checkpoint of the wrong model would have thousands of tensor problems: the first ones say enough.
MAX_TENSOR_PROBLEMS = 10

_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list", dict: "a JSON object"}


@dataclass(frozen=True)
class Field:
    """One config.json field: its type, range or choices, required or its default."""

    name: str
    kind: type
    required: bool = False
    default: Any = None
    minimum: Optional[float] = None
    above: Optional[float] = None  # an exclusive lower bound (a positive number: above=0)
    maximum: Optional[float] = None
    choices: tuple = ()
    supported: str = ""  # how messages name the choices, where a word helps

    def expected(self) -> str:
        text = _KINDS[self.kind]
        if self.minimum is not None:
            text += f" >= {self.minimum}"
        if self.above is not None:
            text += f" > {self.above}"
        if self.maximum is not None:
            text += f" <= {self.maximum}"
        return text


def _int(name: str, required: bool = True, minimum: int = 1, default=None) -> Field:
    return Field(name, int, required=required, minimum=minimum, default=default)


# The text config's fields (`text_config` when the checkpoint is a multimodal one).
FIELDS: tuple[Field, ...] = (
    _int("vocab_size"),
    _int("hidden_size"),
    _int("num_hidden_layers"),
    _int("num_attention_heads"),
    _int("num_key_value_heads"),
    _int("head_dim", required=False),  # default: hidden_size // num_attention_heads
    _int("linear_num_key_heads"),
    _int("linear_num_value_heads"),
    _int("linear_key_head_dim"),
    _int("linear_value_head_dim"),
    _int("linear_conv_kernel_dim"),
    _int("num_experts"),
    _int("num_experts_per_tok"),
    _int("moe_intermediate_size"),
    _int("shared_expert_intermediate_size"),
    _int("full_attention_interval", required=False),  # else read off layer_types
    _int("max_position_embeddings", required=False),
    Field("layer_types", list),
    Field("rms_norm_eps", float, above=0, default=1e-6),
    Field("rope_theta", float, above=0),  # else rope_parameters' (else ExecuTorch's 1e7)
    Field("partial_rotary_factor", float, above=0, maximum=1),  # else rope_parameters', else a quarter
    Field("hidden_act", str, default="silu", choices=ACTIVATIONS),
    Field("attention_bias", bool, default=False, choices=(False,), supported="false (no bias on the attention projections)"),
    Field("norm_topk_prob", bool, default=True, choices=(True,),
          supported="true (the k chosen experts' weights renormalised)"),
    Field("rope_parameters", dict),
    Field("rope_scaling", dict),  # the older name of rope_parameters
)
# Read from the text config, else from the top level (a multimodal config keeps them there).
EITHER_LEVEL: tuple[Field, ...] = (
    Field("tie_word_embeddings", bool, default=False),
    Field("dtype", str, choices=tuple(DTYPES)),
    Field("torch_dtype", str, choices=tuple(DTYPES)),  # the older name of dtype
)
# Inside rope_parameters / rope_scaling.
ROPE_FIELDS: tuple[Field, ...] = (
    Field("rope_type", str, choices=ROPE_TYPES),
    Field("type", str, choices=ROPE_TYPES),  # the older name of rope_type
    Field("rope_theta", float, above=0),
    Field("partial_rotary_factor", float, above=0, maximum=1),
    Field("factor", float, above=0),
    Field("original_max_position_embeddings", int, minimum=1),
    Field("attention_factor", float, above=0),
    Field("mscale", float),
    Field("mscale_all_dim", float),
    Field("beta_fast", float, above=0),
    Field("beta_slow", float, above=0),
    Field("truncate", bool),
)


def json_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _problem(where: str, f: Field, value, prefix: str = "") -> Optional[str]:
    """What is wrong with `value` for field `f` (None: nothing)."""
    name = prefix + f.name
    kind_ok = isinstance(value, f.kind) and not (f.kind in (int, float) and isinstance(value, bool))
    if f.kind is float and isinstance(value, int) and not isinstance(value, bool):
        kind_ok = True
    if not kind_ok:
        return f"{where}: {name}={json_value(value)} is not {_KINDS[f.kind]}; expected {f.expected()}"
    if f.kind in (int, float):
        if ((f.minimum is not None and value < f.minimum) or (f.above is not None and value <= f.above)
                or (f.maximum is not None and value > f.maximum) or value != value):
            return f"{where}: {name}={json_value(value)} is out of range; expected {f.expected()}"
    if f.choices and value not in f.choices:
        supported = f.supported or ", ".join(map(str, f.choices))
        return f"{where}: {name}={json_value(value)} is not supported; supported: {supported}"
    return None


def checked_fields(config: Any, where: str = CONFIG_FILE) -> tuple[dict, list[str]]:
    """(the fields the model reads, with their defaults and what follows from others filled in;
    the problems, one line each). The fields are Hugging Face's names;
    `rope` holds the rotary scaling ({rope_type, factor, ...}) and `dtype` the weights' dtype."""
    if not isinstance(config, dict):
        return {}, [f"{where}: not a JSON object (a Hugging Face config.json is one), but {_KINDS.get(type(config), type(config).__name__)}"]
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        return {}, [f"{where}: text_config={json_value(text)} is not a JSON object"]
    problems: list[str] = []
    out: dict[str, Any] = {}

    def take(f: Field, source: Mapping, prefix: str = "", shown: str = "") -> None:
        if f.name not in source or source[f.name] is None and not f.required:
            if f.required:
                problems.append(f"{where}: missing '{shown}{f.name}' (a Qwen3.5-MoE text config needs it)")
            elif f.default is not None:
                out.setdefault(prefix + f.name, f.default)
            return
        why = _problem(where, f, source[f.name], shown)
        if why:
            problems.append(why)
        else:
            out[prefix + f.name] = float(source[f.name]) if f.kind is float else source[f.name]

    for f in FIELDS:
        take(f, text)
    for f in EITHER_LEVEL:
        take(f, text if f.name in text else config)
    container = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    rope_source = text.get(container) or {}
    if isinstance(rope_source, dict):
        for f in ROPE_FIELDS:
            take(f, rope_source, "rope.", container + ".")
    if problems:  # what follows needs the fields' types right
        return out, problems

    rope = {k.removeprefix("rope."): v for k, v in out.items() if k.startswith("rope.")}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    values = {k: v for k, v in out.items() if not k.startswith("rope.")}
    values["rope"] = {"rope_type": kind, **{k: v for k, v in rope.items() if k not in ("rope_type", "type")}}
    values.setdefault("rope_theta", rope.get("rope_theta"))
    values["partial_rotary_factor"] = values.get("partial_rotary_factor") or rope.get("partial_rotary_factor") \
        or DEFAULT_PARTIAL_ROTARY
    values["dtype"] = values.get("dtype") or values.get("torch_dtype") or "bfloat16"
    values.pop("torch_dtype", None)
    values["head_dim"] = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    if values["head_dim"] < 1:
        problems.append(f"{where}: head_dim is missing and hidden_size // num_attention_heads is 0; give head_dim")
    problems += _relations(values, where)
    return values, problems


def _relations(v: dict, where: str) -> list[str]:
    """What the fields must be together."""
    problems = []

    def multiple(big: str, small: str) -> None:
        if v[big] % v[small]:
            problems.append(f"{where}: {big}={v[big]} is not a multiple of {small}={v[small]}")

    multiple("num_attention_heads", "num_key_value_heads")
    multiple("linear_num_value_heads", "linear_num_key_heads")
    if v["num_experts_per_tok"] > v["num_experts"]:
        problems.append(f"{where}: num_experts_per_tok={v['num_experts_per_tok']} is more than num_experts={v['num_experts']}")
    rotated = int(v["head_dim"] * v["partial_rotary_factor"])
    if rotated < 2 or rotated % 2:
        problems.append(f"{where}: head_dim={v['head_dim']} x partial_rotary_factor={v['partial_rotary_factor']} rotates "
                        f"{rotated} dims; expected an even number >= 2")
    n, kinds = v["num_hidden_layers"], v.get("layer_types")
    if kinds is not None:
        unknown = sorted({k for k in kinds if k not in LAYER_KINDS}, key=str)
        if unknown:
            problems.append(f"{where}: layer_types={json_value(unknown[0])} is not supported; supported: "
                            "'full_attention' and 'linear_attention'")
            return problems
        if len(kinds) != n:
            problems.append(f"{where}: layer_types lists {len(kinds)} layers, num_hidden_layers is {n}")
            return problems
    every = v.get("full_attention_interval")
    if every is None:
        if not kinds or "full_attention" not in kinds:
            problems.append(f"{where}: neither full_attention_interval nor a layer_types list with a full_attention layer")
            return problems
        every = v["full_attention_interval"] = list(kinds).index("full_attention") + 1
    periodic = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if kinds is None:
        v["layer_types"] = periodic
    return problems


# ---------------------------------------------------------------------------------------------
# The tensors


# The text tower's prefix in Qwen3.5's multimodal checkpoints; text-only ones use "model.".
PREFIXES = ("model.language_model.", "model.")
# Tensors of a Qwen3.5 checkpoint that are not part of the text decoder (the vision tower, the
# multi-token-prediction head): neither form reads them.
IGNORED = re.compile(r"^(model\.visual\.|mtp\.|model\.mtp)")


def layout(names) -> tuple[str, bool]:
    """The (prefix, fused experts) a checkpoint uses, read off its tensor names."""
    names = list(names)
    prefix = next((p for p in PREFIXES if any(n.startswith(p + "layers.") for n in names)), PREFIXES[0])
    fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
    return prefix, fused


def expected_tensors(v: Mapping, prefix: str, fused: bool, layers: int = 0) -> dict[str, list[int]]:
    """{name: shape} of every tensor a checkpoint of these fields holds for the first `layers`
    layers (0: all), in Hugging Face's names and layouts (experts fused, [E, 2I, D] and [E, D, I],
    or one tensor per expert)."""
    D, V, H, G, Dh = v["hidden_size"], v["vocab_size"], v["num_attention_heads"], v["num_key_value_heads"], v["head_dim"]
    Hk, Hv, K, Dv = v["linear_num_key_heads"], v["linear_num_value_heads"], v["linear_key_head_dim"], v["linear_value_head_dim"]
    W, E, I, Is = v["linear_conv_kernel_dim"], v["num_experts"], v["moe_intermediate_size"], v["shared_expert_intermediate_size"]
    C = 2 * Hk * K + Hv * Dv  # the delta rule's conv channels: q, k and v
    out = {prefix + "embed_tokens.weight": [V, D], prefix + "norm.weight": [D]}
    if not v.get("tie_word_embeddings"):
        out["lm_head.weight"] = [V, D]
    n = kept_layers(layers, v["num_hidden_layers"])
    for i in range(n):
        p = f"{prefix}layers.{i}."
        out.update({p + "input_layernorm.weight": [D], p + "post_attention_layernorm.weight": [D]})
        if v["layer_types"][i] == "full_attention":
            out.update({
                p + "self_attn.q_proj.weight": [2 * H * Dh, D],  # queries and their output gate
                p + "self_attn.k_proj.weight": [G * Dh, D], p + "self_attn.v_proj.weight": [G * Dh, D],
                p + "self_attn.o_proj.weight": [D, H * Dh],
                p + "self_attn.q_norm.weight": [Dh], p + "self_attn.k_norm.weight": [Dh],
            })
        else:
            out.update({
                p + "linear_attn.in_proj_qkv.weight": [C, D], p + "linear_attn.in_proj_z.weight": [Hv * Dv, D],
                p + "linear_attn.in_proj_b.weight": [Hv, D], p + "linear_attn.in_proj_a.weight": [Hv, D],
                p + "linear_attn.conv1d.weight": [C, 1, W], p + "linear_attn.A_log": [Hv], p + "linear_attn.dt_bias": [Hv],
                p + "linear_attn.norm.weight": [Dv], p + "linear_attn.out_proj.weight": [D, Hv * Dv],
            })
        out.update({
            p + "mlp.gate.weight": [E, D],
            p + "mlp.shared_expert.gate_proj.weight": [Is, D], p + "mlp.shared_expert.up_proj.weight": [Is, D],
            p + "mlp.shared_expert.down_proj.weight": [D, Is], p + "mlp.shared_expert_gate.weight": [1, D],
        })
        if fused:
            out.update({p + "mlp.experts.gate_up_proj": [E, 2 * I, D], p + "mlp.experts.down_proj": [E, D, I]})
        else:
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                out.update({q + "gate_proj.weight": [I, D], q + "up_proj.weight": [I, D], q + "down_proj.weight": [D, I]})
    return out


def allowed_dtypes(config_dtype: str) -> tuple[str, ...]:
    """The safetensors dtypes a tensor of a checkpoint whose config says `config_dtype` may have:
    that one, or float32 (some checkpoints keep norms and the delta rule's decay in full
    precision; both forms' loaders cast)."""
    return tuple(dict.fromkeys((DTYPES[config_dtype], "F32")))


def listed_files(folder: Path) -> tuple[dict[str, Path], dict[Path, dict], list[str]]:
    """({tensor name: the file that holds it}, {file: its header's entries}, problems): the index's
    weight_map checked against each file's header, or the single file's header. Reads each header
    once, and nothing else of the files."""
    index, single = folder / INDEX_FILE, folder / SINGLE_FILE
    problems: list[str] = []
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("weight_map is not {name: file}")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            return {}, {}, [f"{index}: not a safetensors index (no readable weight_map: {e})"]
        claimed = {name: folder / file for name, file in weight_map.items()}
    else:
        found = sorted(folder.glob("*.safetensors"))
        if single.is_file() or len(found) == 1:
            file = single if single.is_file() else found[0]
            claimed = None
        else:
            what = f"{len(found)} .safetensors files and no {INDEX_FILE}" if found else "no .safetensors file"
            return {}, {}, [f"{folder}: {what}; expected {INDEX_FILE} with shards, or one {SINGLE_FILE}"]
    headers: dict[Path, dict] = {}
    for path in sorted(set(claimed.values())) if claimed is not None else [file]:
        try:
            headers[path] = checked_header(path)[0]
        except FileNotFoundError:
            problems.append(f"{path}: no such file (listed by {index.name})")
        except (HeaderError, OSError) as e:
            problems.append(f"{path}: {e}")
    if claimed is None:
        return {name: file for name in headers.get(file, {})}, headers, problems
    for name, path in claimed.items():
        if path in headers and name not in headers[path]:
            problems.append(f"tensor '{name}': {index} lists it in {path.name}, which does not hold it")
    return claimed, headers, problems


def check_tensors(folder: Path, v: Mapping, layers: int = 0) -> list[str]:
    """The problems of the checkpoint's tensors against what the fields imply: missing, unexpected,
    of another shape or dtype (one line each, at most MAX_TENSOR_PROBLEMS of them)."""
    files, headers, problems = listed_files(folder)
    if problems:
        return problems
    prefix, fused = layout(files)
    wanted = expected_tensors(v, prefix, fused, layers)
    kept = kept_layers(layers, v["num_hidden_layers"])
    deeper = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    dtypes = allowed_dtypes(v["dtype"])
    for name in sorted(files):
        m = deeper.match(name)
        if name in wanted or IGNORED.match(name) or (m and int(m.group(1)) >= kept and int(m.group(1)) < v["num_hidden_layers"]):
            continue
        problems.append(f"unexpected tensor '{name}' in {files[name]}: a Qwen3.5-MoE checkpoint of this config.json "
                        "has no such weight")
    missing = [name for name in wanted if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        where = folder / INDEX_FILE if (folder / INDEX_FILE).is_file() else folder
        problems.append(f"missing tensor '{missing[0]}'{more} in {where}")
    for name, shape in wanted.items():
        if name not in files:
            continue
        path = files[name]
        entry = headers[path][name]
        if entry["shape"] != shape:
            problems.append(f"tensor '{name}' in {path} has shape {entry['shape']}, config.json implies {shape}")
        elif entry["dtype"] not in dtypes:
            problems.append(f"tensor '{name}' in {path} is {entry['dtype']}, config.json's dtype {v['dtype']} implies "
                            f"{' or '.join(dtypes)}")
    if len(problems) > MAX_TENSOR_PROBLEMS:
        problems = problems[:MAX_TENSOR_PROBLEMS] + [f"... and {len(problems) - MAX_TENSOR_PROBLEMS} more tensor problems"]
    return problems


def read_config(folder: Path) -> tuple[Any, list[str]]:
    """(config.json's content, problems)."""
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        return None, [f"{folder}: checkpoint directory not found (expected config.json and *.safetensors)"]
    if not path.is_file():
        return None, [f"{path}: missing; a Hugging Face checkpoint directory needs its config.json"]
    try:
        return json.loads(path.read_text()), []
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, [f"{path}: not valid JSON ({e})"]


def check_checkpoint(folder, layers: int = 0) -> tuple[dict, list[str]]:
    """(the checked fields, every problem): config.json against the table, then the
    tensors its fields imply (the first `layers` layers; 0, or more than it has: all) against the
    files' headers. Whether `layers` is more than the checkpoint has is the recipe's resolve's to say."""
    folder = Path(str(folder)).expanduser()
    config, problems = read_config(folder)
    if problems:
        return {}, problems
    values, problems = checked_fields(config, str(folder / CONFIG_FILE))
    if problems:
        return values, problems
    return values, check_tensors(folder, values, layers)
