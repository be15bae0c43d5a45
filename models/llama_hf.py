"""Hugging Face Llama (LlamaForCausalLM) <-> models.llama: config and parameter names.

Pure mapping, no IO; engine/checkpoint/hf.py reads and writes the files. Both models
rotate (first half, second half) of each head ("rotate_half"), so q and k weights map
unchanged: every tensor is the same array under another name.

    ours                                   Hugging Face
    tok_embeddings.weight                  model.embed_tokens.weight
    layers.{i}.attention.w{q,k,v,o}.weight model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.feed_forward.w1.weight      model.layers.{i}.mlp.gate_proj.weight
    layers.{i}.feed_forward.w3.weight      model.layers.{i}.mlp.up_proj.weight
    layers.{i}.feed_forward.w2.weight      model.layers.{i}.mlp.down_proj.weight
    layers.{i}.attention_norm.weight       model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight             model.layers.{i}.post_attention_layernorm.weight
    norm.weight                            model.norm.weight
    output.weight                          lm_head.weight (absent when tie_word_embeddings)
"""

from __future__ import annotations

import re

from common.errors import UserError
from models.llama import LlamaArgs

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"

_BLOCK = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_BACK = {hf: ours for ours, hf in _BLOCK.items()}
_TOP_BACK = {hf: ours for ours, hf in _TOP.items()}
_OURS = re.compile(r"layers\.(\d+)\.(.+)\.weight")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")

# config.json keys that say nothing about the weights; copied from an imported config
# into an exported one, so tokens keep their meaning.
CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def hf_name(fqn: str) -> str:
    """Our state-dict key -> the Hugging Face key. KeyError for a name Llama lacks."""
    if fqn in _TOP:
        return _TOP[fqn]
    match = _OURS.fullmatch(fqn)
    if match and match.group(2) in _BLOCK:
        return f"model.layers.{match.group(1)}.{_BLOCK[match.group(2)]}.weight"
    raise KeyError(fqn)


def hf_tensors(fqn: str, tensor):
    """Our parameter -> {its Hugging Face key: tensor}; one each here (models/mixtral_hf.py
    splits its experts into several)."""
    return {hf_name(fqn): tensor}


def our_tensor(fqn: str, shape: list[int], read, rows: list[int] | None = None):
    """Our parameter, read by its Hugging Face key: whole, or only `rows` along dim 0."""
    return read(hf_name(fqn)) if rows is None else read(hf_name(fqn))[rows]


def our_name(hf: str) -> str:
    """The inverse of hf_name. KeyError for a key with no Llama parameter."""
    if hf in _TOP_BACK:
        return _TOP_BACK[hf]
    match = _THEIRS.fullmatch(hf)
    if match and match.group(2) in _BLOCK_BACK:
        return f"layers.{match.group(1)}.{_BLOCK_BACK[match.group(2)]}.weight"
    raise KeyError(hf)


def refuse(source: str, key: str, value, supported: str) -> UserError:
    return UserError(f"{source}: {key}={value!r} is not supported; {supported}.")


def get(config: dict, key: str, kind, source: str, default=None):
    value = config.get(key, default)
    if value is None:
        raise UserError(f"{source} has no {key!r}, which the model needs.")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UserError(f"{source}: {key}={value!r} must be {'an integer' if kind is int else kind.__name__}.")
    return value


def _rope(config: dict, source: str) -> tuple[float, tuple[float, float, float, int] | None]:
    """(rope_theta, rope_scaling) from either layout: transformers 5 writes
    rope_parameters {rope_type, rope_theta, ...}; 4.x wrote rope_theta and rope_scaling."""
    params = config.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = config.get("rope_scaling"), "rope_scaling"
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise refuse(source, key, params, "give an object with rope_type 'default' or 'llama3'")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    theta = get({"rope_theta": theta}, "rope_theta", float, source)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise refuse(source, f"{key}.rope_type", rope_type,
                     "this Llama supports rope_type 'default' and 'llama3' (Llama 3.1/3.2)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(source, f"{key}.partial_rotary_factor", params["partial_rotary_factor"],
                     "only 1.0 (rope on the whole head) is supported")
    original = params.get("original_max_position_embeddings", config.get("max_position_embeddings"))
    scaling = (get(params, "factor", float, f"{source} ({key})"),
               get(params, "low_freq_factor", float, f"{source} ({key})"),
               get(params, "high_freq_factor", float, f"{source} ({key})"),
               get({"original_max_position_embeddings": original}, "original_max_position_embeddings",
                   int, f"{source} ({key})"))
    return theta, scaling


def args_from_hf_config(config: dict, source: str) -> LlamaArgs:
    """LlamaArgs from a Hugging Face config.json (already parsed). `source` names the file
    in error messages. Anything our Llama does not compute the same way is refused."""
    if not isinstance(config, dict):
        raise UserError(f"{source} holds a {type(config).__name__}, not a JSON object.")
    model_type = config.get("model_type")
    if model_type != "llama":
        raise refuse(source, "model_type", model_type, "checkpoint.hf_import reads Llama checkpoints "
                     "(model_type 'llama', architectures ['LlamaForCausalLM']) and Mixtral ones "
                     "(model_type 'mixtral', with model.name=llama_moe)")
    architectures = config.get("architectures")
    if architectures is not None and ARCHITECTURE not in architectures:
        raise refuse(source, "architectures", architectures, f"only {ARCHITECTURE} is read")
    for key, supported in (("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, False) is not supported:
            raise refuse(source, key, config.get(key), "this Llama has no biases (false)")
    if config.get("hidden_act", "silu") != "silu":
        raise refuse(source, "hidden_act", config.get("hidden_act"), "the feed-forward is SwiGLU ('silu')")
    dim = get(config, "hidden_size", int, source)
    n_heads = get(config, "num_attention_heads", int, source)
    if dim % n_heads:
        raise UserError(f"{source}: hidden_size={dim} does not divide into num_attention_heads={n_heads}.")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != dim // n_heads:
        raise refuse(source, "head_dim", head_dim, f"this Llama needs head_dim = hidden_size / "
                     f"num_attention_heads = {dim // n_heads}")
    n_kv_heads = get(config, "num_key_value_heads", int, source, default=n_heads)
    if n_heads % n_kv_heads:
        raise UserError(f"{source}: num_attention_heads={n_heads} is not a multiple of "
                        f"num_key_value_heads={n_kv_heads}.")
    theta, scaling = _rope(config, source)
    tie = config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise UserError(f"{source}: tie_word_embeddings={tie!r} must be true or false.")
    return LlamaArgs(
        dim=dim, n_layers=get(config, "num_hidden_layers", int, source), n_heads=n_heads,
        n_kv_heads=n_kv_heads, ffn_hidden=get(config, "intermediate_size", int, source),
        vocab_size=get(config, "vocab_size", int, source),
        max_seq_len=get(config, "max_position_embeddings", int, source, default=2048),
        rope_theta=theta, norm_eps=get(config, "rms_norm_eps", float, source, default=1e-6),
        tie_embeddings=tie, rope_scaling=scaling)


def hf_config_from_args(args: LlamaArgs, carried: dict | None = None, dtype: str = "float32") -> dict:
    """A config.json for LlamaForCausalLM with these shapes. It uses the rope_theta and
    rope_scaling keys, which transformers 4.x reads and 5.x converts. `carried` gives
    values for CARRIED_KEYS (an imported config)."""
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.ffn_hidden,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": dtype,  # what transformers >= 4.56 writes; older ones wrote torch_dtype
    }
    if args.rope_scaling is not None:
        factor, low, high, original = args.rope_scaling
        config["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                  "high_freq_factor": high, "original_max_position_embeddings": original}
    for key in CARRIED_KEYS:
        if carried and carried.get(key) is not None:
            config[key] = carried[key]
    return config
