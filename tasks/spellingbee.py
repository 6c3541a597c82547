"""
Synthetic spelling tasks from an English word list (dwyl/english-words words_alpha.txt, 370k words).

- SpellingBee: "how many 'r' are in 'strawberry'?". The reference answer spells the word out one letter per line
  with a running count, then checks the count with the python tool, then states it as "#### n". Tokens hide the
  letters inside a word from the model; spelling it out first turns the question into one it can see.
- SimpleSpelling: "Spell the word: cat" -> "cat:c,a,t". Teaches the word -> letters mapping SpellingBee relies on.

Both are generated on the fly: example i is drawn from its own random.Random seeded by (task, split, i), so any
slice is reproducible without generating what comes before it. The word list is read from
<data_dir>/words/words_alpha.txt, else <base_dir>/words_alpha.txt, downloading it there if needed.
"""

import functools
import os
import random
import string

from nanochat.data.task_data import TaskDataNotFound, task_data_dir
from nanochat.data.download import download_file
from tasks.common import Task
from tasks.gsm8k import extract_answer

WORDS_URL = "https://raw.githubusercontent.com/dwyl/english-words/refs/heads/master/words_alpha.txt"

# How users ask. A few are not in English: the answer format stays the same, the model learns the question's shape.
USER_TEMPLATES = [
    "How many {letter} are in the word {word}?",
    "How many {letter}s are in {word}?",
    "How many times does the letter {letter} appear in {word}?",
    "Count the number of {letter} in {word}.",
    "Count how many times {letter} occurs in the word {word}",
    "In the word {word}, how many {letter} are there?",
    "how many {letter} in {word}",
    "What is the count of the letter {letter} in {word}?",
    "Tell me how many {letter}'s the word {word} has.",
    "Can you count the {letter} in {word} for me?",
    "I need the number of occurrences of {letter} in {word}.",
    "Number of {letter} in {word}?",
    "{word}: how many {letter}?",
    "Quick question: how many {letter} does {word} contain?",
    "¿Cuántas {letter} hay en la palabra {word}?",
    "Combien de {letter} y a-t-il dans le mot {word} ?",
    "Wie oft kommt der Buchstabe {letter} im Wort {word} vor?",
    "Quante {letter} ci sono nella parola {word}?",
]
QUOTES = ["'{}'", '"{}"', "{}"]


@functools.lru_cache(maxsize=4)
def _read_words(path):
    with open(path, encoding="utf-8") as f:
        words = [w.strip() for w in f]  # strip() also removes the file's CRLF line ends
    words = [w for w in words if w]
    if not words:
        raise ValueError(f"word list {path} is empty")
    return tuple(words)


def load_words(data_dir=None, base_dir=None, download=True, url=None):
    """The word list as a tuple of lowercase words (see the module docstring for where it is looked for)."""
    url = url or WORDS_URL

    looked = []
    local = task_data_dir(data_dir)
    if local is not None:
        path = local / "words" / "words_alpha.txt"
        if path.is_file():
            return _read_words(str(path))
        looked.append(f"{path} (missing)")
    if base_dir is None:
        from nanochat.common import get_base_dir

        base_dir = get_base_dir()
    path = os.path.join(base_dir, "words_alpha.txt")
    if not os.path.isfile(path):
        looked.append(f"{path} (missing)")
        if not download:
            raise TaskDataNotFound("the SpellingBee word list", looked)
        try:
            download_file(url, path)
        except OSError as e:
            looked.append(f"download from {url} failed ({e})")
            raise TaskDataNotFound("the SpellingBee word list", looked) from None
    return _read_words(path)


class _WordTask(Task):
    name = ""

    def __init__(self, size=1000, split="train", data_dir=None, **kwargs):
        super().__init__(**kwargs)
        if split not in ("train", "test"):
            raise ValueError(f"{type(self).__name__} split must be train or test, got {split!r}")
        if not (isinstance(size, int) and size > 0):
            raise ValueError(f"{type(self).__name__} size must be a positive int, got {size!r}")
        self.size, self.split = size, split
        self.words = load_words(data_dir)

    @property
    def eval_type(self):
        return "generative"

    def num_examples(self):
        return self.size

    def rng(self, index):
        # str seeds are hashed with sha512 by random.seed: stable across runs and PYTHONHASHSEED
        return random.Random(f"{self.name}/{self.split}/{index}")


class SpellingBee(_WordTask):
    name = "spellingbee"

    def get_example(self, index):
        rng = self.rng(index)
        word = rng.choice(self.words)
        # mostly a letter of the word, sometimes any letter, so that "0" is a possible answer but not the usual one
        letter = rng.choice(word) if rng.random() < 0.9 else rng.choice(string.ascii_lowercase)
        count = word.count(letter)
        template = rng.choice(USER_TEMPLATES)
        quote = rng.choice(QUOTES)
        question = template.format(letter=quote.format(letter), word=quote.format(word))
        if rng.random() < 0.3:
            question = question.lower()

        lines, running = [], 0
        for ch in word:
            if ch == letter:
                running += 1
                lines.append(f"{ch} <- match, count = {running}")
            else:
                lines.append(ch)
        manual = (f"We are asked how many times the letter '{letter}' appears in the word '{word}'. "
                  f"Let me spell the word out, one letter per line, and count as I go:\n\n"
                  + "\n".join(lines)
                  + f"\n\nCounting by hand gives {count}.\n\nLet me double-check with Python:\n\n")
        parts = [
            {"type": "text", "text": manual},
            {"type": "python", "text": f"'{word}'.count('{letter}')"},
            {"type": "python_output", "text": str(count)},
            {"type": "text", "text": f"\n\nPython also gives {count}, so the two agree.\n\nMy final answer is:\n\n#### {count}"},
        ]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": parts}]
        return {"messages": messages, "word": word, "letter": letter, "count": count}

    def evaluate(self, conversation, assistant_response):
        """1 if the response's '#### n' equals the true count, else 0."""
        return int(extract_answer(assistant_response) == str(conversation["count"]))

    def reward(self, conversation, assistant_response):
        return float(self.evaluate(conversation, assistant_response))


class SimpleSpelling(_WordTask):
    name = "simplespelling"

    def get_example(self, index):
        word = self.rng(index).choice(self.words)
        messages = [
            {"role": "user", "content": f"Spell the word: {word}"},
            {"role": "assistant", "content": f"{word}:{','.join(word)}"},
        ]
        return {"messages": messages, "word": word}

    def evaluate(self, conversation, assistant_response):
        return int(assistant_response.strip() == conversation["messages"][-1]["content"])
