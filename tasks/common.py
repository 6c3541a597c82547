"""
The Task abstraction shared by every dataset in tasks/.

A task is a list of conversations: {"messages": [{"role": ..., "content": ...}, ...], ...extra keys}.
The content of a message is a string, or (for tool use) a list of parts {"type": "text"|"python"|
"python_output", "text": str}. Extra keys carry what `evaluate` needs (e.g. "letters" for multiple choice).

Slicing: Task(start, stop, step) is a lazy view over the underlying examples, so a training script can take
e.g. every 8th example from rank r with Task(start=r, step=8) without materialising anything.
"""

import math
import random


class Task:
    def __init__(self, start=0, stop=None, step=1):
        if not (isinstance(start, int) and start >= 0):
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        if stop is not None and not (isinstance(stop, int) and stop >= start):
            raise ValueError(f"stop must be None or an int >= start ({start}), got {stop!r}")
        if not (isinstance(step, int) and step >= 1):
            raise ValueError(f"step must be an int >= 1, got {step!r}")
        self.start, self.stop, self.step = start, stop, step

    @property
    def eval_type(self):
        """'categorical' (answer is one of a few letters, scored by logits) or 'generative' (sampled, then checked)."""
        raise NotImplementedError

    def num_examples(self):
        """Number of examples in the underlying dataset, before slicing."""
        raise NotImplementedError

    def get_example(self, index):
        """The conversation at `index` of the underlying dataset (physical index, not sliced)."""
        raise NotImplementedError

    def evaluate(self, conversation, assistant_response):
        """Score an assistant response (a string) to `conversation`; 1/True means correct."""
        raise NotImplementedError

    def __len__(self):
        stop = self.num_examples() if self.stop is None else min(self.stop, self.num_examples())
        return max(0, math.ceil((stop - self.start) / self.step))

    def __getitem__(self, index):
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {type(self).__name__} of length {n}")
        return self.get_example(self.start + index * self.step)


class TaskMixture(Task):
    """
    All examples of several tasks in one deterministic shuffled order (seed 42), for training mixtures.
    Listing a task twice oversamples it 2x. Every rank builds the same order, so ranks can stride over it.
    """

    def __init__(self, tasks, **kwargs):
        super().__init__(**kwargs)
        if not tasks:
            raise ValueError("TaskMixture needs at least one task")
        self.tasks = tasks
        self.index_map = [(ti, i) for ti, task in enumerate(tasks) for i in range(len(task))]
        random.Random(42).shuffle(self.index_map)

    def num_examples(self):
        return len(self.index_map)

    def get_example(self, index):
        ti, i = self.index_map[index]
        return self.tasks[ti][i]


class TaskSequence(Task):
    """Several tasks one after the other, in order (e.g. a curriculum)."""

    def __init__(self, tasks, **kwargs):
        super().__init__(**kwargs)
        if not tasks:
            raise ValueError("TaskSequence needs at least one task")
        self.tasks = tasks
        self.lengths = [len(t) for t in tasks]

    def num_examples(self):
        return sum(self.lengths)

    def get_example(self, index):
        for task, n in zip(self.tasks, self.lengths):
            if index < n:
                return task[index]
            index -= n
        raise IndexError(f"index out of range for TaskSequence of {self.num_examples()} examples")


def render_mc(question, letters, choices):
    """
    nanochat's multiple-choice prompt. Each choice comes *before* its letter ("- Paris=A"): a small model then
    only has to bind the letter it emits to the choice text right next to it, instead of looking back across
    the letter-first layout. No space before the letter, so " A" and "A" don't compete as two different tokens:
    the answer is always the bare letter token, which is what categorical evaluation reads the logits of.
    """
    if len(letters) != len(choices):
        raise ValueError(f"render_mc: {len(letters)} letters for {len(choices)} choices")
    lines = [f"Multiple Choice question: {question}"]
    lines += [f"- {choice}={letter}" for letter, choice in zip(letters, choices)]
    return "\n".join(lines) + "\n\nRespond only with the letter of the correct answer."


def validate_messages(messages, where):
    """Check a conversation's shape: optional system first, then user/assistant alternating, user first."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: a conversation must be a non-empty list of messages, got {type(messages).__name__}")
    start = 1 if isinstance(messages[0], dict) and messages[0].get("role") == "system" else 0
    if len(messages) - start < 2:
        raise ValueError(f"{where}: a conversation needs at least one user and one assistant message")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError(f"{where}: message {i} must be an object with 'role' and 'content'")
        if i >= start:
            expected = "user" if (i - start) % 2 == 0 else "assistant"
            if msg["role"] != expected:
                raise ValueError(f"{where}: message {i} has role {msg['role']!r}, expected {expected!r} "
                                 f"(roles must alternate user/assistant after an optional system message)")
        if not isinstance(msg["content"], (str, list)):
            raise ValueError(f"{where}: message {i} content must be a string or a list of parts")
