"""HF checkpoints: parity of logits with transformers' own Qwen3 / Qwen2 / Llama implementations,
bitwise save/load round trips, sharded folders, and the error messages."""

import json
from dataclasses import asdict, replace

import pytest
import torch

from minippo.models import (
    Transformer,
    ValueModel,
    from_pretrained,
    hf_config_from_model_args,
    hf_name,
    init_weights,
    llama3_2_1b,
    model_args_from_hf_config,
    native_name,
    qwen2_5_0_5b,
    qwen3_0_6b,
    qwen3_tiny,
    save_pretrained,
    save_pretrained_state_dict,
    value_model_from_pretrained,
)

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def hf_config(arch: str, tie: bool):
    if arch == "qwen3":
        return transformers.Qwen3Config(
            **COMMON,
            head_dim=24,
            tie_word_embeddings=tie,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(
            **COMMON,
            tie_word_embeddings=tie,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
    return transformers.LlamaConfig(**COMMON, tie_word_embeddings=tie, rope_parameters=LLAMA3_ROPE)


def random_hf_model(arch: str, tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch, tie), dtype=torch.float32)
    with torch.no_grad():  # every parameter random (norm weights around 1, biases non-zero)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model.eval()


def padded_batch(lengths, S, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (len(lengths), S), generator=g)
    mask = torch.zeros(len(lengths), S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, S - n :] = True
    return tokens, mask, (mask.long().cumsum(-1) - 1).clamp(min=0)


CASES = [("qwen3", True), ("qwen3", False), ("qwen2", False), ("qwen2", True), ("llama", False)]


@pytest.mark.parametrize(("arch", "tie"), CASES)
def test_logits_match_transformers(arch, tie, tmp_path):
    ref = random_hf_model(arch, tie)
    ref.save_pretrained(str(tmp_path))
    ours = from_pretrained(tmp_path)
    assert ours.args.architecture == type(ref).__name__
    assert ours.args.tie_word_embeddings == tie
    assert (ours.output.weight is ours.tok_embeddings.weight) == tie
    if arch == "llama":
        assert ours.args.rope_scaling["rope_type"] == "llama3"

    # positions up to 200 exercise every band of the llama3 frequency scaling
    tokens = torch.randint(0, 96, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
        got = ours(tokens)
    diff = (got - want).abs().max().item()
    print(f"\nparity {arch} tie={tie}: max|diff| = {diff:.2e}")
    assert diff <= 1e-5
    if arch == "llama":  # the check can see the RoPE scaling: without it the logits differ
        assert ref.model.rotary_emb.rope_type == "llama3"
        plain = Transformer(replace(ours.args, rope_scaling=None))
        plain.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (plain(tokens) - want).abs().max() > 1e-3

    tokens, mask, pos = padded_batch([5, 11, 8], S=11, vocab=96, seed=2)
    with torch.no_grad():
        want = ref(tokens, attention_mask=mask.long(), position_ids=pos).logits
        got = ours(tokens, attention_mask=mask, position_ids=pos)
    diff = (got[mask] - want[mask]).abs().max().item()
    print(f"parity {arch} tie={tie} left-padded: max|diff| = {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize(("arch", "tie"), [("qwen3", True), ("llama", False)])
def test_save_pretrained_round_trip_is_bitwise_and_readable_by_transformers(arch, tie, tmp_path):
    src = tmp_path / "src"
    random_hf_model(arch, tie).save_pretrained(str(src))
    ours = from_pretrained(src)
    out = tmp_path / "out"
    save_pretrained(ours, out, max_shard_bytes=40_000)  # forces several shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert ("lm_head.weight" in index["weight_map"]) == (not tie)
    back = from_pretrained(out)
    sd0, sd1 = ours.state_dict(), back.state_dict()
    assert sd0.keys() == sd1.keys()
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        assert (ref(tokens).logits - back(tokens)).abs().max() <= 1e-5
    # a native model saved in bf16 and loaded in its stored dtype keeps its values exactly
    save_pretrained(back.to(torch.bfloat16), tmp_path / "bf16")
    bf = from_pretrained(tmp_path / "bf16", dtype=None)
    assert bf.tok_embeddings.weight.dtype == torch.bfloat16
    assert torch.equal(bf.tok_embeddings.weight, back.tok_embeddings.weight)


def test_native_model_round_trip_and_state_dict_path(tmp_path):
    model = init_weights(Transformer(qwen3_tiny()), seed=3)
    save_pretrained(model, tmp_path / "a")
    assert not (tmp_path / "a" / "model.safetensors.index.json").exists()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    save_pretrained_state_dict(sd, model.args, tmp_path / "b")
    a, b = from_pretrained(tmp_path / "a"), from_pretrained(tmp_path / "b")
    tokens = torch.randint(0, 64, (2, 5))
    assert torch.equal(a(tokens), model(tokens)) and torch.equal(b(tokens), model(tokens))


def test_value_model_from_actor_checkpoint(tmp_path):
    actor = init_weights(Transformer(qwen3_tiny()), seed=4)
    save_pretrained(actor, tmp_path)
    critic = value_model_from_pretrained(tmp_path)
    assert isinstance(critic, ValueModel)
    assert torch.equal(
        critic.layers[1].feed_forward.w2.weight, actor.layers[1].feed_forward.w2.weight
    )
    tokens = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(critic(tokens), torch.zeros(2, 5))
    with torch.no_grad():
        h = actor(tokens, return_hidden=True)
        critic.value_head.weight.fill_(1.0)
        v = critic(tokens)
    # with a head of ones the value is Σ_d h_d: the head's matmul and h.sum(-1) add the same D
    # float32 terms in different orders, each within (D − 1)·u·Σ_d|h_d| of the exact sum
    D, u = h.shape[-1], torch.finfo(torch.float32).eps / 2
    assert ((v - h.sum(-1)).abs() <= 2 * (D - 1) * u * h.abs().sum(-1)).all()


def test_name_map_round_trips():
    model = Transformer(qwen3_tiny())
    for name in model.state_dict():
        assert native_name(hf_name(name)) == name
    assert hf_name("layers.12.feed_forward.w1.weight") == "model.layers.12.mlp.gate_proj.weight"
    assert (
        native_name("model.layers.3.self_attn.k_norm.weight") == "layers.3.attention.k_norm.weight"
    )
    with pytest.raises(KeyError, match="visual"):
        native_name("model.visual.proj.weight")


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        from_pretrained(tmp_path)

    model = init_weights(Transformer(qwen3_tiny()), seed=0)
    save_pretrained(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())

    bad = dict(cfg, architectures=["MistralForCausalLM"])
    with pytest.raises(
        ValueError,
        match=r"MistralForCausalLM.*Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM",
    ):
        model_args_from_hf_config(bad)

    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=120)))
    msg = r"shape mismatch for .model.layers.0.mlp.down_proj.weight.*\(64, 128\).*\(64, 120\)"
    with pytest.raises(ValueError, match=msg):
        from_pretrained(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.2\."):
        from_pretrained(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=1)))
    with pytest.raises(ValueError, match=r"unexpected tensors.*model\.layers\.1\."):
        from_pretrained(tmp_path)

    with pytest.raises(TypeError, match="ValueModel"):
        save_pretrained(ValueModel(qwen3_tiny()), tmp_path / "critic")


QWEN3_0_6B_CONFIG = {  # config.json of Qwen/Qwen3-0.6B (transformers 4.x layout)
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN2_5_0_5B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
LLAMA3_2_1B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
}


@pytest.mark.parametrize(
    ("config", "builder"),
    [
        (QWEN3_0_6B_CONFIG, qwen3_0_6b),
        (QWEN2_5_0_5B_CONFIG, qwen2_5_0_5b),
        (LLAMA3_2_1B_CONFIG, llama3_2_1b),
    ],
)
def test_builders_match_published_configs(config, builder):
    got = asdict(model_args_from_hf_config(config))
    want = asdict(builder())
    got.pop("extra_hf_config"), want.pop("extra_hf_config")
    assert got == want
    # and the written config reads back to the same args
    again = asdict(model_args_from_hf_config(hf_config_from_model_args(builder())))
    again.pop("extra_hf_config")
    assert again == want
