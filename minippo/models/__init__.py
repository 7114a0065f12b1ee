"""Native decoder models (Qwen3; Qwen2 and Llama-3 as options), builders, logprobs, HF I/O, tokenizers.

Public names:
    ModelArgs, Transformer, ValueModel, KVCache, init_weights, rope_inv_freq
        ``Transformer(args)(tokens, *, position_ids, attention_mask, kv_cache, return_hidden)``
        -> logits [B, S, V]; ``ValueModel(args)(tokens, *, position_ids, attention_mask)`` -> [B, S]
    builders (zero-argument, return ModelArgs): qwen3_tiny, qwen3_0_6b, qwen3_1_7b, qwen3_4b,
        qwen3_8b, qwen2_5_0_5b, llama3_2_1b
    token_logprobs(model, input_ids, *, attention_mask, position_ids, temperature, start, chunk_size)
        -> [B, S - start];  token_logprobs_and_entropy(...) -> (logprobs, entropy); both run
        inside Transformer.forward via ``score=ScoreSpec(start, temperature, chunk_size, ...)``;
        response_logprobs(model, batch, *, temperature) -> [B, R] of a RolloutBatch
    fused_policy_loss(model, input_ids, FusedLossSpec(...), *, attention_mask, position_ids,
        temperature, start, chunk_size) -> FusedPolicyOutput(loss, stats, kl_stats, logprobs,
        entropy): rl.policy_loss (+ β·rl.kl_loss) with the lm_head fused, no recompute in backward
    pack(attention_mask, *, start) -> PackedLayout: the real tokens of a padded batch as one
        stream; every function above and both models take it as ``packed=`` (real tokens only,
        outputs in their padded shapes, zeros at padding)
    HF folders: from_pretrained(path, dtype, device) -> Transformer; save_pretrained(model, path, *,
        max_shard_bytes); save_pretrained_state_dict(native_sd, args, path); load_hf_state_dict;
        value_model_from_pretrained; model_args_from_hf_config(dict); hf_config_from_model_args;
        model_args_from_pretrained(path); load_pretrained_weights(model, path) (into a built,
        possibly sharded model, one tensor at a time); iter_hf_tensors(path);
        hf_name(native) / native_name(hf)
    Tokenizer (Protocol: encode, decode, apply_chat_template, eos_id, eos_ids, pad_id, bos_id,
        vocab_size); TinyTokenizer() built-in char tokenizer; load_tokenizer(path) -> HFTokenizer
"""

from minippo.models.fused_policy_loss import FusedLossSpec, FusedPolicyOutput
from minippo.models.hf_checkpoint import (
    from_pretrained,
    hf_config_from_model_args,
    hf_name,
    iter_hf_tensors,
    load_hf_state_dict,
    load_pretrained_weights,
    model_args_from_hf_config,
    model_args_from_pretrained,
    native_name,
    save_pretrained,
    save_pretrained_state_dict,
    value_model_from_pretrained,
)
from minippo.models.logprobs import (
    ScoreSpec,
    fused_policy_loss,
    response_logprobs,
    token_logprobs,
    token_logprobs_and_entropy,
)
from minippo.models.model import (
    SUPPORTED_ARCHITECTURES,
    KVCache,
    ModelArgs,
    Transformer,
    ValueModel,
    init_weights,
    llama3_2_1b,
    qwen2_5_0_5b,
    qwen3_0_6b,
    qwen3_1_7b,
    qwen3_4b,
    qwen3_8b,
    qwen3_tiny,
    rope_inv_freq,
)
from minippo.models.packing import PackedLayout, pack
from minippo.models.tokenizer import (
    TOKENIZER_FILES,
    HFTokenizer,
    TinyTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TOKENIZER_FILES",
    "FusedLossSpec",
    "FusedPolicyOutput",
    "HFTokenizer",
    "KVCache",
    "ModelArgs",
    "PackedLayout",
    "ScoreSpec",
    "TinyTokenizer",
    "Tokenizer",
    "Transformer",
    "ValueModel",
    "from_pretrained",
    "fused_policy_loss",
    "hf_config_from_model_args",
    "hf_name",
    "init_weights",
    "iter_hf_tensors",
    "llama3_2_1b",
    "load_hf_state_dict",
    "load_pretrained_weights",
    "load_tokenizer",
    "model_args_from_hf_config",
    "model_args_from_pretrained",
    "native_name",
    "pack",
    "qwen2_5_0_5b",
    "qwen3_0_6b",
    "qwen3_1_7b",
    "qwen3_4b",
    "qwen3_8b",
    "qwen3_tiny",
    "response_logprobs",
    "rope_inv_freq",
    "save_pretrained",
    "save_pretrained_state_dict",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "value_model_from_pretrained",
]
