"""Arithmetic generator, tokenizers, file loading, tokenized dataset and greedy evaluation."""

import json
import re

import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lazyzero.app.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    Difficulty,
    Problem,
    TokenizedExamples,
    exact_match_accuracy,
    extract_answer,
    format_example,
    format_prompt,
    format_solution,
    generate_problems,
    greedy_generate,
    load_texts,
    load_tokenizer,
    training_texts,
)
from lazyzero.models import build_model

STEP = re.compile(r"^(\d+)([+\-*])(\d+)=<<(\d+)([+\-*])(\d+)=(\d+)>>(\d+)$")


@pytest.fixture
def one_thread():
    """The tiny model's ops are too small to gain from threads; on a shared CPU the thread pool's
    contention instead made the overfit test ~15x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- arithmetic problems


def test_same_seed_same_problems_and_different_seeds_differ():
    assert generate_problems(50, seed=3) == generate_problems(50, seed=3)
    assert generate_problems(50, seed=3) != generate_problems(50, seed=4)


def test_train_and_eval_splits_share_no_question():
    train = {p.question for p in generate_problems(3000, seed=0, split="train")}
    evaluation = {p.question for p in generate_problems(500, seed=0, split="eval")}
    assert len(train) == 3000 and len(evaluation) == 500
    assert not train & evaluation


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_every_annotated_step_is_correct_and_chains_to_the_answer(difficulty):
    for problem in generate_problems(300, seed=1, difficulty=difficulty):
        lines = format_example(problem).splitlines()
        assert lines[-1] == f"#### {problem.answer}"
        steps = [lines[1].removeprefix("Answer: ")] + lines[2:-1]
        assert tuple(steps) == problem.steps
        running = int(re.search(r" has (\d+) ", problem.question).group(1))
        for step in steps:
            left, op, right, left2, op2, right2, result, shown = STEP.match(step).groups()
            assert (left, op, right) == (left2, op2, right2) and result == shown
            assert int(left) == running
            running = {"+": int(left) + int(right), "-": int(left) - int(right), "*": int(left) * int(right)}[op]
            assert running == int(result) >= 0
        assert running == problem.answer == extract_answer(format_example(problem))


def test_easy_problems_are_short_with_small_answers():
    problems = generate_problems(1000, seed=0)
    assert all(len(p.steps) == 2 for p in problems)
    assert max(len(format_example(p).encode("utf-8")) for p in problems) <= 190
    assert max(p.answer for p in problems) < 100


def test_custom_difficulty_is_respected():
    level = Difficulty(steps=3, max_start=5, max_operand=5, max_multiplier=2, max_result=20)
    problems = generate_problems(100, seed=0, difficulty=level)
    assert all(len(p.steps) == 3 and p.answer <= 20 for p in problems)


def test_bad_generator_arguments_are_rejected():
    with pytest.raises(ValueError, match="split"):
        generate_problems(1, seed=0, split="test")
    with pytest.raises(ValueError, match="easy, medium, hard"):
        generate_problems(1, seed=0, difficulty="extreme")
    with pytest.raises(ValueError, match="max_result >= max_start"):
        Difficulty(max_start=20, max_result=10)
    with pytest.raises(ValueError, match="steps >= 1"):
        Difficulty(steps=0)
    with pytest.raises(ValueError, match="distinct"):
        generate_problems(1000, seed=0, difficulty=Difficulty(steps=1, max_start=2, max_operand=1, max_multiplier=2))


def test_prompt_is_the_prefix_of_the_example_where_the_answer_starts():
    problem = generate_problems(1, seed=0)[0]
    prompt, example = format_prompt(problem), format_example(problem)
    assert example.startswith(prompt) and prompt.endswith("Answer: ")
    assert example[len(prompt) :].startswith(problem.steps[0])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("#### 7", 7),
        ("steps\n####   42\nQuestion: more\n#### 9\n", 42),
        ("#### -3", -3),
        ("#### 1,234 apples", 1234),
        ("#### 7.", 7),
        ("#### 7.0", 7),
        ("#### 7.5", None),
        ("####", None),
        ("#### seven", None),
        ("no marker 12", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips_unicode_and_frames_with_specials():
    tokenizer = ByteTokenizer()
    text = "Zoë has 3 €-coins 🍎\n"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert tokenizer.decode(ids + [tokenizer.pad_id]) == text
    assert tokenizer.encode("ab", add_bos=False) == [97, 98]
    assert tokenizer.vocab_size == 259 and max(tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == 258


def test_byte_tokenizer_decodes_invalid_utf8_without_raising():
    euro = list("€".encode("utf-8"))
    assert ByteTokenizer().decode([97] + euro[:2] + [98]) == "a\ufffdb"


def test_load_tokenizer_errors_name_the_path(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_tokenizer(str(missing))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        load_tokenizer(str(tmp_path))


def save_word_level_tokenizer(folder, with_pad: bool, chat_template: str | None = None):
    """A WordLevel tokenizer trained offline on a few strings, saved as an HF tokenizer folder."""
    specials = ["[UNK]", "<s>", "</s>"] + (["<pad>"] if with_pad else [])
    rust = RustTokenizer(models.WordLevel(unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    rust.train_from_iterator(["Tom has 3 apples", "Ana has 4 pens", "user assistant"],
                             trainers.WordLevelTrainer(special_tokens=specials))
    extra = {"pad_token": "<pad>"} if with_pad else {}
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="[UNK]", bos_token="<s>", eos_token="</s>", **extra)
    hf.chat_template = chat_template
    hf.save_pretrained(folder)


@pytest.mark.parametrize("with_pad", [True, False])
def test_local_tokenizer_folder_behaves_like_the_byte_tokenizer(tmp_path, with_pad):
    save_word_level_tokenizer(tmp_path, with_pad)
    tokenizer = load_tokenizer(str(tmp_path))
    ids = tokenizer.encode("Tom has 4 pens", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id and len(ids) == 6
    assert tokenizer.decode(ids) == "Tom has 4 pens"
    words = {"Tom", "Ana", "has", "3", "4", "apples", "pens", "user", "assistant"}
    assert tokenizer.vocab_size == len(words) + (4 if with_pad else 3)
    # Special tokens come first in the trained vocabulary: [UNK] 0, <s> 1, </s> 2, <pad> 3.
    assert tokenizer.pad_id == (3 if with_pad else tokenizer.eos_id)


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant {% endif %}")


def test_a_model_folder_brings_its_own_tokenizer_and_chat_template(tmp_path):
    build_model("tiny").save_pretrained(tmp_path)
    assert isinstance(load_tokenizer(None, model=str(tmp_path)), ByteTokenizer)  # weights without a tokenizer
    assert isinstance(load_tokenizer(None, model="tiny"), ByteTokenizer)
    save_word_level_tokenizer(tmp_path, with_pad=True, chat_template=CHAT_TEMPLATE)
    tokenizer = load_tokenizer(None, model=str(tmp_path))
    problem = Problem(question="Tom has 3 apples", steps=("3+4=<<3+4=7>>7",), answer=7)
    prompt = format_prompt(problem, tokenizer.chat)
    assert prompt == "<s>user Tom has 3 apples</s><s>assistant "
    assert format_example(problem, tokenizer.chat) == f"{prompt}{format_solution(problem)}</s>"
    # The template writes bos and eos itself: a framed text gets neither added.
    framed = TokenizedExamples([prompt], tokenizer, seq_len=12, framed=True)[0]["input_ids"].tolist()
    assert framed[:2] == [tokenizer.bos_id, tokenizer.encode("user", add_bos=False)[0]]
    assert framed.count(tokenizer.eos_id) == 1


# ---------------------------------------------------------------- data files


def test_generated_training_texts_are_formatted_train_problems():
    texts = training_texts(num_examples=20, seed=5)
    assert texts == [format_example(p) for p in generate_problems(20, seed=5)]


def test_txt_examples_are_blank_line_separated_blocks(tmp_path):
    file = tmp_path / "data.txt"
    file.write_text("Question: a\nAnswer: 1\n\n\n  \nsecond example\r\n\r\nthird\n")
    assert load_texts(str(file)) == ["Question: a\nAnswer: 1\n", "second example\n", "third\n"]


def test_jsonl_accepts_text_or_question_and_answer(tmp_path):
    file = tmp_path / "data.jsonl"
    rows = [{"text": "hello"}, {"question": "What is 2+2? ", "answer": "2+2=<<2+2=4>>4\n#### 4"}]
    file.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_texts(str(file)) == ["hello\n", "Question: What is 2+2?\nAnswer: 2+2=<<2+2=4>>4\n#### 4\n"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{"text": "cut\n', "data.jsonl:2: malformed JSON"),
        ('{"text": "ok"}\n\n[1, 2]\n', "data.jsonl:3: expected a JSON object"),
        ('{"question": "q"}\n', "data.jsonl:1: needs a 'text' field or both"),
        ('{"text": 5}\n', "data.jsonl:1: field 'text' must be a string"),
        ("\n  \n", "data.jsonl contains no examples"),
    ],
)
def test_malformed_jsonl_errors_name_file_and_line(tmp_path, content, message):
    file = tmp_path / "data.jsonl"
    file.write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_texts(str(file))


def test_file_level_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_texts(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="empty.txt contains no examples"):
        load_texts(str(tmp_path / "empty.txt"))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data.csv must end in .txt or .jsonl"):
        load_texts(str(tmp_path / "data.csv"))
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match="latin1.txt is not UTF-8"):
        load_texts(str(tmp_path / "latin1.txt"))


# ---------------------------------------------------------------- tokenized dataset


def test_tokenized_examples_pad_mask_and_label():
    tokenizer = ByteTokenizer()
    dataset = TokenizedExamples(["ab\n", "abcde\n"], tokenizer, seq_len=8)
    first = dataset[0]
    assert first["input_ids"].tolist() == [257, 97, 98, 10, 258, 256, 256, 256]
    assert first["attention_mask"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert first["labels"].tolist() == [257, 97, 98, 10, 258] + [IGNORE_INDEX] * 3
    assert first["input_ids"].dtype == torch.long and len(dataset) == 2
    assert dataset[1]["attention_mask"].sum() == 8


def test_tokenized_examples_count_truncations_in_one_warning():
    with pytest.warns(UserWarning, match="2 of 3 examples are longer than seq_len=4"):
        dataset = TokenizedExamples(["a", "abcd", "abcdefgh"], ByteTokenizer(), seq_len=4)
    assert dataset[2]["input_ids"].tolist() == [257, 97, 98, 99]


# ---------------------------------------------------------------- greedy evaluation


@pytest.mark.usefixtures("one_thread")
def test_greedy_generate_is_batch_size_invariant_under_left_padding():
    model = build_model("tiny", seed=1)
    model.train()
    tokenizer = ByteTokenizer()
    prompts = [format_prompt(p) for p in generate_problems(5, seed=0, split="eval")] + ["Hi", "Zoë?"]
    one_by_one = greedy_generate(model, tokenizer, prompts, max_new_tokens=12, batch_size=1)
    padded = greedy_generate(model, tokenizer, prompts, max_new_tokens=12, batch_size=4)
    assert one_by_one == padded
    assert model.training


@pytest.mark.usefixtures("one_thread")
def test_greedy_generate_matches_decoding_without_cache():
    """The cached, last-position-only decoding (`logits_to_keep=1`) picks the same tokens as
    re-running the whole sequence and reading every position's logits at each step."""
    model = build_model("tiny", seed=3).eval()
    tokenizer = ByteTokenizer()
    prompt = format_prompt(generate_problems(1, seed=0, split="eval")[0])
    [generated] = greedy_generate(model, tokenizer, [prompt], max_new_tokens=10, batch_size=1)
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        for _ in range(10):
            next_token = model(input_ids=ids).logits[:, -1].argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, next_token], dim=-1)
    new_tokens = ids[0, len(tokenizer.encode(prompt)):].tolist()
    if tokenizer.eos_id in new_tokens:
        new_tokens = new_tokens[: new_tokens.index(tokenizer.eos_id)]
    assert generated == tokenizer.decode(new_tokens)


class CountingModel(torch.nn.Module):
    """Wraps a model and counts forward passes: decoding must not stop early on eos."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.model(**kwargs)


def test_every_batch_runs_exactly_max_new_tokens_forward_passes():
    counting = CountingModel(build_model("tiny", seed=2))
    greedy_generate(counting, ByteTokenizer(), ["a", "b", "c"], max_new_tokens=5, batch_size=2)
    assert counting.calls == 2 * 5


@pytest.mark.usefixtures("one_thread")
def test_exact_match_finds_a_memorized_problem():
    """Overfit sanity: the tiny model trained on one problem must reproduce its answer."""
    tokenizer = ByteTokenizer()
    problem = generate_problems(1, seed=0, split="eval")[0]
    model = build_model("tiny", seed=0)
    batch = {k: v[None] for k, v in TokenizedExamples([format_example(problem)], tokenizer, 192)[0].items()}
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(100):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    other = generate_problems(2, seed=1, split="eval")[1]
    result = exact_match_accuracy(model, tokenizer, [problem, other], max_new_tokens=48, batch_size=2, num_samples=1)
    assert result.correct >= 1 and result.total == 2
    prompt = format_prompt(problem)
    assert result.samples == ((prompt, format_example(problem)[len(prompt) :], problem.answer),)
