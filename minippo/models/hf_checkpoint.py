"""HF checkpoint folders <-> native models.

An HF folder holds ``config.json`` and either ``model.safetensors`` or several
``model-0000k-of-0000n.safetensors`` listed in ``model.safetensors.index.json``. Parameter names are
converted with a key map whose ``{}`` stands for the layer index::

    layers.{}.attention.wq.weight  <->  model.layers.{}.self_attn.q_proj.weight

A tied lm_head (``tie_word_embeddings``) is never written and never required; a stored
``lm_head.weight`` of a tied checkpoint is ignored (the embedding is the lm_head), as are the
``rotary_emb.inv_freq`` buffers some old Llama checkpoints carry.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from minippo.models.model import SUPPORTED_ARCHITECTURES, ModelArgs, Transformer, ValueModel

__all__ = [
    "check_hf_folder",
    "check_safetensors_file",
    "from_pretrained",
    "hf_config_from_model_args",
    "hf_name",
    "load_hf_state_dict",
    "model_args_from_hf_config",
    "native_name",
    "save_pretrained",
    "save_pretrained_state_dict",
    "value_model_from_pretrained",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

# native name -> HF name; "{}" is the layer index
_NATIVE_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "value_head.weight": "score.weight",
    "value_head.bias": "score.bias",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}
for _n, _h in [("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")]:
    for _kind in ("weight", "bias"):
        _NATIVE_TO_HF[f"layers.{{}}.attention.{_n}.{_kind}"] = (
            f"model.layers.{{}}.self_attn.{_h}.{_kind}"
        )
for _n, _h in [("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")]:
    for _kind in ("weight", "bias"):
        _NATIVE_TO_HF[f"layers.{{}}.feed_forward.{_n}.{_kind}"] = (
            f"model.layers.{{}}.mlp.{_h}.{_kind}"
        )
_HF_TO_NATIVE = {v: k for k, v in _NATIVE_TO_HF.items()}
_LAYER = re.compile(r"(?<=layers\.)\d+(?=\.)")


def _convert(name: str, table: dict[str, str], direction: str) -> str:
    m = _LAYER.search(name)
    key = _LAYER.sub("{}", name, count=1) if m else name
    if key not in table:
        raise KeyError(f"no {direction} name for parameter {name!r}")
    out = table[key]
    return out.replace("{}", m.group(0)) if m else out


def hf_name(native: str) -> str:
    """Native parameter name -> HF name, e.g. ``layers.3.feed_forward.w1.weight`` ->
    ``model.layers.3.mlp.gate_proj.weight``."""
    return _convert(native, _NATIVE_TO_HF, "HF")


def native_name(hf: str) -> str:
    """HF parameter name -> native name (inverse of :func:`hf_name`)."""
    return _convert(hf, _HF_TO_NATIVE, "native")


# ----------------------------------------------------------------------------------------------
# config.json

_MODEL_TYPE = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
_DERIVED_KEYS = {
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "torch_dtype",
    "dtype",
}


def model_args_from_hf_config(config: Mapping) -> ModelArgs:
    """ModelArgs from an HF ``config.json`` dict (Qwen3ForCausalLM, Qwen2ForCausalLM,
    LlamaForCausalLM). RoPE settings are read from ``rope_parameters`` (transformers >= 5) or
    ``rope_theta`` / ``rope_scaling`` (older files)."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} (config 'architectures': {archs}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
    if config.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported; set it to false in config.json")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    rope = dict(config.get("rope_parameters") or {})
    if config.get("rope_scaling"):
        rope = {**dict(config["rope_scaling"]), **rope}
    theta = rope.get("rope_theta", config.get("rope_theta", 10_000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None
    if rope_type != "default":
        rope_scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
        rope_scaling["rope_type"] = rope_type
    attention_bias = bool(config.get("attention_bias", False))
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    return ModelArgs(
        vocab_size=config["vocab_size"],
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or dim // n_heads,
        intermediate_size=config["intermediate_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=rope_scaling,
        max_seq_len=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
        o_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
        architecture=arch,
        extra_hf_config={k: v for k, v in config.items() if k not in _DERIVED_KEYS},
    )


def hf_config_from_model_args(args: ModelArgs, dtype: torch.dtype | None = None) -> dict:
    """The ``config.json`` dict of ``args`` (inverse of :func:`model_args_from_hf_config`)."""
    if args.architecture == "Qwen3ForCausalLM" and not args.qk_norm:
        raise ValueError(
            "Qwen3ForCausalLM needs qk_norm=True; use Qwen2ForCausalLM or LlamaForCausalLM"
        )
    if args.architecture != "Qwen3ForCausalLM" and args.qk_norm:
        raise ValueError(f"{args.architecture} has no q/k norm; set qk_norm=False")
    if args.architecture == "Qwen2ForCausalLM" and (
        not args.qkv_bias or args.o_bias or args.mlp_bias
    ):
        raise ValueError("Qwen2ForCausalLM needs qkv_bias=True, o_bias=False, mlp_bias=False")
    if args.architecture != "Qwen2ForCausalLM" and args.qkv_bias != args.o_bias:
        raise ValueError(
            f"{args.architecture} uses one attention_bias for q/k/v/o; set qkv_bias == o_bias"
        )
    if args.architecture == "Qwen3ForCausalLM" and args.mlp_bias:
        raise ValueError("Qwen3ForCausalLM has no mlp bias; set mlp_bias=False")
    rope_parameters = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rope_parameters = {**args.rope_scaling, "rope_theta": args.rope_theta}
    cfg = {
        **args.extra_hf_config,
        "architectures": [args.architecture],
        "model_type": _MODEL_TYPE[args.architecture],
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": args.qkv_bias,
    }
    if args.rope_scaling is not None:
        cfg["rope_scaling"] = dict(args.rope_scaling)
    if args.architecture == "LlamaForCausalLM":
        cfg["mlp_bias"] = args.mlp_bias
    if dtype is not None:
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    return cfg


# ----------------------------------------------------------------------------------------------
# Loading


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"{str(cfg_path)!r} not found: an HF checkpoint folder needs config.json next to its "
            "*.safetensors files"
        )
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{str(cfg_path)!r} is corrupt or truncated (not valid JSON: {e}); restore it from "
            "the model's source"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{str(cfg_path)!r} is not a JSON object; restore it from the model's source"
        )
    return config


def check_safetensors_file(file: str | Path) -> None:
    """Raise ValueError naming ``file`` when it is truncated or its header is corrupt (reads the
    header only: the 8-byte length, the JSON header and the file size it implies)."""
    file = Path(file)
    size = file.stat().st_size
    fix = "download or copy it again"
    with open(file, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ValueError(f"{str(file)!r} is corrupt or truncated (no valid header); {fix}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(
                f"{str(file)!r} has a corrupt header (not valid JSON); {fix}"
            ) from None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    need = 8 + n + max(ends, default=0)
    if size < need:
        raise ValueError(
            f"{str(file)!r} is truncated: {size} bytes, its header describes {need}; {fix}"
        )


def check_hf_folder(path: str | Path) -> ModelArgs:
    """The :class:`ModelArgs` of an HF folder, after checking that config.json and every
    safetensors file are complete (headers and sizes only, no tensor is read). Raises
    FileNotFoundError / ValueError naming the missing, corrupt or truncated file."""
    folder = Path(path)
    args = model_args_from_hf_config(_read_config(folder))
    for file in _safetensors_files(folder):
        check_safetensors_file(file)
    return args


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(
                f"{str(index)!r} is corrupt or truncated (no valid weight_map); restore it from "
                "the model's source"
            ) from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists files that do not exist: {missing}")
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(
            f"no *.safetensors in {str(folder)!r} (only safetensors checkpoints are supported)"
        )
    return found


def _expected_shapes(args: ModelArgs, critic: bool) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = ValueModel(args) if critic else Transformer(args)
    sd = model.state_dict()
    if critic:
        sd = {k: v for k, v in sd.items() if not k.startswith("value_head.")}
    elif args.tie_word_embeddings:
        sd.pop("output.weight")
    return {k: v.shape for k, v in sd.items()}


def model_args_from_pretrained(path: str | Path) -> ModelArgs:
    """The :class:`ModelArgs` of an HF folder, from its config.json alone (no weights are read)."""
    return model_args_from_hf_config(_read_config(Path(path)))


def iter_hf_tensors(
    path: str | Path, *, critic: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(native_name, tensor)`` of an HF folder, one tensor at a time in the stored dtype, every
    name and shape checked against config.json (unexpected names fail before the first tensor is
    read; missing ones after the last). The tied lm_head is skipped; with ``critic=True`` the
    lm_head is not required either (a critic initialised from an actor)."""
    from safetensors import safe_open

    folder = Path(path)
    args = model_args_from_pretrained(folder)
    expected = _expected_shapes(args, critic)
    ignore_lm_head = critic or args.tie_word_embeddings
    plan: list[tuple[Path, str, str]] = []  # (file, hf key, native name)
    unexpected: list[str] = []
    for file in _safetensors_files(folder):
        check_safetensors_file(file)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.endswith("rotary_emb.inv_freq") or (
                    ignore_lm_head and key == "lm_head.weight"
                ):
                    continue
                try:
                    name = native_name(key)
                except KeyError:
                    unexpected.append(key)
                    continue
                if name not in expected:
                    unexpected.append(key)
                    continue
                plan.append((file, key, name))
    if unexpected:
        raise ValueError(
            f"unexpected tensors in {str(folder)!r} for {args.architecture}: "
            f"{sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    missing = [hf_name(k) for k in expected if k not in {name for _, _, name in plan}]
    if missing:
        raise ValueError(
            f"missing tensors in {str(folder)!r} for {args.architecture}: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)"
        )
    for file, key, name in plan:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            t = f.get_tensor(key)
        if t.shape != expected[name]:
            raise ValueError(
                f"shape mismatch for {key!r} in {file.name}: checkpoint has "
                f"{tuple(t.shape)}, config.json implies {tuple(expected[name])}"
            )
        yield name, t


def load_hf_state_dict(
    path: str | Path,
    *,
    dtype: torch.dtype | None = torch.float32,
    device: torch.device | str = "cpu",
    critic: bool = False,
) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Read an HF folder into ``(args, {native_name: tensor})``, every name and shape checked.

    dtype None keeps the stored dtype. The tied lm_head is not in the returned dict. With
    ``critic=True`` the lm_head is not required either (a critic initialised from an actor).
    """
    args = model_args_from_pretrained(path)
    sd = {
        name: t.to(device=device, dtype=dtype or t.dtype)
        for name, t in iter_hf_tensors(path, critic=critic)
    }
    return args, sd


@torch.no_grad()
def load_pretrained_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Copy an HF folder's weights into a built model in place; returns ``model``.

    The model is a :class:`Transformer` or a :class:`ValueModel` (whose ``value_head`` is set to
    0, so a new critic starts predicting 0), materialised (``to_empty``) and possibly FSDP2-sharded.
    Tensors are read one at a time: a sharded parameter keeps only this rank's shard of each, so
    no rank ever holds more than its shards plus one full tensor (no full model on the host).
    """
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    critic = "value_head.weight" in params
    for name, t in iter_hf_tensors(path, critic=critic):
        _copy_full_into(params[name], t)
    if critic:
        params["value_head.weight"].zero_()
        params["value_head.bias"].zero_()
    return model


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """``param.copy_(full)`` where ``param`` may be a DTensor shard (each rank keeps its part)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        full = full.to(device=param.device_mesh.device_type, dtype=param.dtype)
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


def from_pretrained(
    path: str | Path, dtype: torch.dtype | None = torch.float32, device: torch.device | str = "cpu"
) -> Transformer:
    """Load an HF checkpoint folder (config.json + *.safetensors) into a native :class:`Transformer`
    on ``device`` in ``dtype`` (None keeps the stored dtype). Values are loaded bit for bit."""
    args, sd = load_hf_state_dict(path, dtype=dtype, device=device)
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_word_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    model.tie_weights()
    return model


def value_model_from_pretrained(
    path: str | Path, dtype: torch.dtype | None = torch.float32, device: torch.device | str = "cpu"
) -> ValueModel:
    """A critic whose backbone is the checkpoint's (lm_head dropped) and whose ``value_head`` is 0
    (so it starts predicting 0 everywhere)."""
    args, sd = load_hf_state_dict(path, dtype=dtype, device=device, critic=True)
    ref = next(iter(sd.values()))
    sd["value_head.weight"] = torch.zeros(1, args.dim, dtype=ref.dtype, device=ref.device)
    sd["value_head.bias"] = torch.zeros(1, dtype=ref.dtype, device=ref.device)
    with torch.device("meta"):
        model = ValueModel(args)
    model.load_state_dict(sd, strict=True, assign=True)
    return model


# ----------------------------------------------------------------------------------------------
# Saving


def save_pretrained_state_dict(
    state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    args: ModelArgs,
    path: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write full tensors with native names (e.g. a gathered FSDP state dict) as an HF folder.

    ``output.weight`` is skipped when ``args.tie_word_embeddings``. Shards of at most
    ``max_shard_bytes`` (a single tensor larger than that gets its own file); several shards get a
    ``model.safetensors.index.json``.
    """
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes ({max_shard_bytes}) must be positive")
    items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    expected = _expected_shapes(args, critic=False)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in items:
        if name == "output.weight" and args.tie_word_embeddings:
            continue
        if name not in expected:
            raise ValueError(
                f"unexpected tensor {name!r} for {args.architecture} (expected native names such "
                "as 'layers.0.attention.wq.weight'; a ValueModel cannot be saved in HF format)"
            )
        if hasattr(t, "full_tensor"):
            raise ValueError(
                f"{name!r} is a sharded DTensor; gather it first (gather_full_state_dict)"
            )
        if t.shape != expected[name]:
            raise ValueError(
                f"shape mismatch for {name!r}: {tuple(t.shape)} vs {tuple(expected[name])}"
            )
        tensors[hf_name(name)] = t.detach().to("cpu").contiguous()
    missing = [hk for hk in map(hf_name, expected) if hk not in tensors]
    if missing:
        raise ValueError(f"state dict lacks {missing[:8]} ({len(missing)} in all)")

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
        total += nbytes
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("*.safetensors"), folder / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    dtype = next(iter(tensors.values())).dtype
    with open(folder / "config.json", "w") as f:
        json.dump(hf_config_from_model_args(args, dtype), f, indent=2)
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    n = len(shards)
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    with open(folder / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_pretrained(
    model: nn.Module, path: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> None:
    """Write a (non-sharded) :class:`Transformer` as an HF folder readable by
    :func:`from_pretrained` and by ``transformers``. For an FSDP-sharded model gather the tensors
    first and call :func:`save_pretrained_state_dict`."""
    if not isinstance(model, Transformer):
        raise TypeError(
            f"save_pretrained expects a minippo Transformer, got {type(model).__name__}; "
            "critics are saved with the training checkpoint"
        )
    save_pretrained_state_dict(
        model.state_dict(), model.args, path, max_shard_bytes=max_shard_bytes
    )
