"""Prompt loading with `datasets` from local files, chat templates, length filtering."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from minippo.data import SAMPLES_DIR, MathAnswerMatch, format_prompt, load_prompt_dataset
from minippo.models import TinyTokenizer, load_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A word-level tokenizer folder with a Qwen-style chat template (no download)."""
    folder = tmp_path_factory.mktemp("tok")
    words = ["<|im_start|>", "<|im_end|>", "<unk>", "user", "assistant", "system", "<think>"]
    words += ["</think>", "\n"]
    words += [
        w
        for line in (SAMPLES_DIR / "math_qa.jsonl").read_text().splitlines()
        for w in json.loads(line)["question"].split()
    ]
    words += ["Be", "brief.", "Show", "work."]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE})
    )
    return load_tokenizer(folder)


def test_format_prompt_chat_plain_and_format_string(hf_tokenizer):
    text = format_prompt(hf_tokenizer, "Be brief.", system_prompt="Show work.")
    assert text == (
        "<|im_start|>system\nShow work.<|im_end|>\n<|im_start|>user\nBe brief.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_think = format_prompt(hf_tokenizer, "x", chat_template_kwargs={"enable_thinking": False})
    assert no_think.endswith("<|im_start|>assistant\n<think></think>\n")
    tiny = TinyTokenizer()
    assert format_prompt(tiny, "1+1=", template="plain") == "1+1="
    assert (
        format_prompt(tiny, "2+2", template="q: {prompt}\na:", prompt_suffix="?") == "q: 2+2?\na:"
    )
    msgs = [{"role": "user", "content": "hi"}]
    assert format_prompt(tiny, msgs, template="plain", prompt_suffix=" there") == "hi there"
    with pytest.raises(ValueError, match="format string containing"):
        format_prompt(tiny, "x", template="nope")
    with pytest.raises(ValueError, match="'role' and 'content'"):
        format_prompt(tiny, [{"text": "x"}], template="plain")


def test_load_jsonl_with_chat_template_and_math_reward(hf_tokenizer):
    ds = load_prompt_dataset(
        hf_tokenizer, source="json", data_files=str(SAMPLES_DIR / "math_qa.jsonl")
    )
    assert len(ds) == 6
    ex = ds[0]
    assert ex.prompt.startswith("<|im_start|>user\nA baker")
    assert list(ex.prompt_ids) == hf_tokenizer.encode(ex.prompt)
    assert ex.answer.endswith("#### 25")
    reward = MathAnswerMatch()
    assert reward(ex, r"7*12-59 = \boxed{25}") == 1.0
    assert reward(ds[4], "each gets 5/3, so the answer is 5/3") == 1.0  # "#### 5/3"
    assert reward(ds[3], "#### -7") == 1.0 and reward(ds[3], "#### 7") == 0.0


def test_load_message_prompts_nested_answer_and_parquet(tmp_path):
    import datasets

    tiny_rows = [
        {"prompt": [{"role": "user", "content": f"{i}+{i}="}], "meta": {"gt": str(2 * i)}}
        for i in range(5)
    ]
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(tiny_rows).to_parquet(str(path))
    ds = load_prompt_dataset(
        TinyTokenizer(),
        source="parquet",
        data_files=[str(path)],
        prompt_key="prompt",
        answer_key="meta.gt",
        template="plain",
        num_examples=3,
    )
    assert [e.prompt for e in ds] == ["0+0=", "1+1=", "2+2="]
    assert [e.answer for e in ds] == ["0", "2", "4"]


def test_sample_with_messages_loads():
    tiny_chat = TinyTokenizer()
    rows = [json.loads(x) for x in (SAMPLES_DIR / "math_messages.jsonl").read_text().splitlines()]
    assert rows[1]["reward_model"]["ground_truth"] == r"\frac{3}{4}"
    with pytest.raises(ValueError, match="cannot encode"):  # '^' is not in the tiny vocab
        load_prompt_dataset(
            tiny_chat,
            source="jsonl",
            data_files=str(SAMPLES_DIR / "math_messages.jsonl"),
            prompt_key="prompt",
            answer_key="reward_model.ground_truth",
        )


def test_length_filter_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"q": "1" * n, "a": "1"}) for n in (2, 8, 3)) + "\n")
    tok = TinyTokenizer()
    ds = load_prompt_dataset(
        tok,
        source="json",
        data_files=str(path),
        prompt_key="q",
        answer_key="a",
        template="plain",
        max_prompt_tokens=4,
    )
    assert [e.prompt for e in ds] == ["11", "111"] and [e.index for e in ds] == [0, 1]
    with pytest.raises(ValueError, match="raise it"):
        load_prompt_dataset(
            tok,
            source="json",
            data_files=str(path),
            prompt_key="q",
            answer_key="a",
            template="plain",
            max_prompt_tokens=1,
        )
    with pytest.raises(ValueError, match=r"prompt_key='question': .* no field 'question'"):
        load_prompt_dataset(tok, source="json", data_files=str(path), template="plain")
    with pytest.raises(ValueError, match="set data_files"):
        load_prompt_dataset(tok, source="parquet")


def test_a_missing_key_names_it_and_lists_the_fields(tmp_path):
    import datasets

    tok = TinyTokenizer()
    jsonl = tmp_path / "qa.jsonl"
    jsonl.write_text(json.dumps({"problem": "1+1", "solution": "2"}) + "\n")
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(tok, source="jsonl", data_files=str(jsonl), template="plain")
    msg = str(err.value)
    assert msg.startswith("prompt_key='question': the rows of ") and str(jsonl) in msg
    assert "no field 'question' (its fields: problem, solution)" in msg
    assert msg.endswith("set prompt_key to one of them")
    with pytest.raises(
        ValueError, match=r"answer_key='answer': .*\(its fields: problem, solution\)"
    ):
        load_prompt_dataset(
            tok, source="jsonl", data_files=str(jsonl), prompt_key="problem", template="plain"
        )

    # nested keys (DAPO-Math's reward_model.ground_truth), in a parquet file
    parquet = tmp_path / "dapo.parquet"
    rows = [{"prompt": "2+2", "reward_model": {"style": "rule", "truth": "4"}}]
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    kw = {"prompt_key": "prompt", "template": "plain"}
    with pytest.raises(
        ValueError,
        match=r"answer_key='reward_model.ground_truth': .* no field 'ground_truth' in "
        r"'reward_model' \(its fields: style, truth\)",
    ):
        load_prompt_dataset(
            tok,
            source="parquet",
            data_files=str(parquet),
            answer_key="reward_model.ground_truth",
            **kw,
        )
    with pytest.raises(ValueError, match=r"'prompt' is a str, not a record"):
        load_prompt_dataset(tok, source=str(parquet), answer_key="prompt.text", **kw)
    # the right keys load, with the source given as the file's path
    ds = load_prompt_dataset(tok, source=str(parquet), answer_key="reward_model.truth", **kw)
    assert [(e.prompt, e.answer) for e in ds] == [("2+2", "4")]
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_prompt_dataset(tok, source=str(tmp_path / "missing.parquet"), **kw)


@pytest.mark.parametrize(
    ("config", "sample"),
    [
        ("qwen3_0_6b_gsm8k_1gpu", "math_qa.jsonl"),
        ("qwen3_4b_dapo_math_8gpu", "math_messages.jsonl"),
    ],
)
def test_real_model_configs_dataset_and_reward_on_sample_files(hf_tokenizer, config, sample):
    """The shipped configs' dataset + reward nodes, pointed at the sample files (no download)."""
    from minippo.config import instantiate, load_config

    cfg = load_config(config, ["dataset.source=json", f"dataset.data_files={SAMPLES_DIR / sample}"])
    ds = instantiate(cfg.dataset, tokenizer=hf_tokenizer)
    reward = instantiate(cfg.reward)
    assert len(ds) >= 4
    ex = ds[0]
    assert ex.prompt.startswith("<|im_start|>user\n") and ex.prompt.endswith("<think></think>\n")
    answer = ex.answer.split("####")[-1].strip()
    assert reward(ex, f"... so \\boxed{{{answer}}}") == 1.0
    assert reward(ex, "no idea") == 0.0
