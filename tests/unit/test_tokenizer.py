"""Tokenizers: TinyTokenizer round trips; load_tokenizer against transformers' AutoTokenizer."""

import json
import shutil

import pytest

from minippo.models import TOKENIZER_FILES, TinyTokenizer, Tokenizer, load_tokenizer, qwen3_tiny

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}{{ eos_token }}\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% else %}<|assistant|>{{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "what is 12 + 7? the answer is 19.",
    "hello world, hello tokenizer",
    "the quick brown fox jumps over the lazy dog",
    "def f(x): return x * 2",
]
SAMPLES = ["hello world", "what is 3 * 4?", "  spaces   and\nnewlines ", "unseen wörds ü", ""]


def test_tiny_tokenizer_round_trip_and_vocab():
    tok = TinyTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 51)
    assert tok.vocab_size <= qwen3_tiny().vocab_size
    text = "what is 12 + 3 * (4 - 5)?\nanswer: 0."
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.encode("0 9a") == [3, 13, 12, 20]
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert tok.decode([tok.eos_id], skip_special_tokens=False) == "<eos>"
    with pytest.raises(ValueError, match="'A'"):
        tok.encode("A")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([51])
    assert tok.apply_chat_template([{"role": "user", "content": "1+1="}]) == "1+1=\n"


def test_tiny_tokenizer_reserved_ids_up_to_vocab_size():
    """vocab_size pads the vocabulary with reserved ids (a real model's embedding padding): the
    tokens keep their ids, a reserved id decodes to nothing (as the tokenizers library decodes
    an id without a token), an id past vocab_size is still refused."""
    tok = TinyTokenizer(extra_tokens=["}"], vocab_size=151_936)
    plain = TinyTokenizer(extra_tokens=["}"])
    assert tok.vocab_size == 151_936 and plain.vocab_size == 52
    assert tok.encode("3012=}") == plain.encode("3012=}")
    assert tok.decode([6, 51, 52, 151_935, 3]) == "3}0"  # 52 and 151,935 are reserved
    with pytest.raises(ValueError, match="outside"):
        tok.decode([151_936])
    for bad in (51, 10.0, True):
        with pytest.raises(ValueError, match=r"tokenizer\.vocab_size"):
            TinyTokenizer(extra_tokens=["}"], vocab_size=bad)


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, processors, trainers

    d = tmp_path_factory.mktemp("tok")
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    raw.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS, trainer)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": {
                    "__type": "AddedToken",
                    "content": "</s>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                },
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 6]}))
    return d


def test_load_tokenizer_matches_transformers(hf_tokenizer_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    tok = load_tokenizer(hf_tokenizer_dir)
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == len(ref)
    assert tok.eos_ids == (2, 6) and tok.eos_id == 2
    assert tok.pad_id == ref.pad_token_id == 3
    assert tok.bos_id == ref.bos_token_id == 1
    for s in SAMPLES:
        ids = tok.encode(s)
        assert ids == ref.encode(s, add_special_tokens=False), s
        assert tok.encode(s, add_special_tokens=True) == ref.encode(s) == [1, *ids], s
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), s
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": " what is 3 * 4? "},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "and 5 * 5?"},
    ]
    for gen_prompt in (True, False):
        got = tok.apply_chat_template(messages, add_generation_prompt=gen_prompt)
        want = ref.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=False)
        assert got == want
    assert got.startswith("<s><|system|>be brief</s>\n<|user|>what is 3 * 4?</s>")


def test_load_tokenizer_reads_chat_template_jinja_written_by_transformers(
    hf_tokenizer_dir, tmp_path
):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    ref.save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    )
    assert tok.encode("hello world") == ref.encode("hello world", add_special_tokens=False)


def test_tokenizer_files_are_all_an_export_needs(hf_tokenizer_dir, tmp_path):
    """Copying TOKENIZER_FILES (what the recipe's HF export copies) keeps the tokenizer whole,
    including a chat template that transformers wrote to chat_template.jinja."""
    from transformers import AutoTokenizer

    src, dst = tmp_path / "src", tmp_path / "dst"
    AutoTokenizer.from_pretrained(str(hf_tokenizer_dir)).save_pretrained(str(src))
    assert (src / "chat_template.jinja").is_file()
    dst.mkdir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    a, b = load_tokenizer(src), load_tokenizer(dst)
    msgs = [{"role": "user", "content": "hi"}]
    assert b.apply_chat_template(msgs) == a.apply_chat_template(msgs)
    assert (b.eos_ids, b.pad_id, b.bos_id) == (a.eos_ids, a.pad_id, a.bos_id)
    assert b.encode("hello world") == a.encode("hello world")


def test_load_tokenizer_errors(tmp_path, hf_tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((hf_tokenizer_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="no eos token"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(tmp_path)
    assert tok.pad_id == tok.eos_id == 2 and tok.bos_id is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
