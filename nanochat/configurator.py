"""
Command-line flags for every entry point (scripts/, bench/, nanochat.dataset, nanochat.setup_check), nanochat style.

Each script declares its flags once, with the help text users see:

    FLAGS = Flags(
        "model",                                                  # a heading: the flags below are grouped under it
        Flag("depth", 20, "transformer blocks; width and heads follow from it"),
        Flag("eval_tokens", None, "tokens per validation; auto: 20 x 524288 (a few batches on CPU)", type=int),
        Flag("source", "sft", "which checkpoints to load", choices=["base", "mid", "sft", "rl"], short="i"),
    )
    config = parse_flags_or_exit(FLAGS, argv, description=__doc__)   # a dict: config["depth"] (or config.depth)

Accepted forms: `--depth=20`, `--depth 20`, `--device-batch-size=32`, `--device_batch_size 32`, a short alias where one
is declared (`-i sft`), and positional arguments where declared (import_hf's DIR). A flag's type is its default's, or
`type=` when the default is None. None means "auto": the script works the value out (from the device, the model...),
`--help` prints it as `auto`, and `--flag=auto` asks for it explicitly; a value the user passes always wins, even one
equal to what auto would pick. Booleans take 1/0/true/false/yes/no/on/off, or nothing (`--fp8` = `--fp8=1`). A
number flag may also take a few words, kept as the word (`words=["auto"]`: --resume_from_step is a step number or
auto). An environment switch that changes what a run does is the default of a flag (`Flag(..., env="NANOCHAT_COMPILE")`):
when the variable is set, its value is the flag's default, checked as a command-line value would be (an error names
the variable), so the parsed flags a run records are what it ran with.
`choices`, `min`/`max` (inclusive bounds of a number) and a `check` function are checked here, once, with an error
that names the flag and the values it takes; relations between flags are declared beside them as Rule items
(`Rule(("warmup_ratio", "warmdown_ratio"), lambda a, b: a + b <= 1, "...")`) and checked after parsing, before the
script does any work. Unknown flags are errors that suggest close names. A FlagError is a usage error
(nanochat/usage.py): one line, exit status 2. Scripts read the result as a plain dict (checkpoints store it as
user_config).
"""

import difflib
import os
import sys
import textwrap

from nanochat.usage import BadValue, exit_with


class FlagError(BadValue):
    pass


_TRUE = {"1", "true", "yes", "on", "t", "y"}
_FALSE = {"0", "false", "no", "off", "f", "n"}
_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str"}


class Flag:
    """One flag: its name (a_b spelling), default, help text and optional choices / type / short alias."""

    def __init__(self, name, default, help, choices=None, type=None, short=None, positional=False, required=False,
                 hidden=False, check=None, many=False, min=None, max=None, env=None, words=()):
        if not help or not help.strip():
            raise ValueError(f"flag --{name} needs a help text (what it does, what its values mean)")
        if type is None:
            if default is None:
                raise ValueError(f"flag --{name}: a None (auto) default needs an explicit type=int|float|str|bool")
            type = builtin_type(default)
        if type not in _TYPE_NAMES:
            raise ValueError(f"flag --{name}: type must be one of bool, int, float, str, got {type!r}")
        if short is not None and not (len(short) == 1 and short.isalpha() and short != "h"):
            raise ValueError(f"flag --{name}: short alias must be one letter other than h, got {short!r}")
        self.name, self.default, self.help, self.type = name, default, " ".join(help.split()), type
        self.choices = list(choices) if choices is not None else None
        self.short, self.positional, self.required, self.hidden = short, positional, required, hidden
        self.check = check  # optional: check(value) raises ValueError with the message for a bad value
        # inclusive bounds of a number; a value that is not one passes them (e.g. --resume_from_step=auto)
        self.min, self.max = min, max
        self.many = many  # a list of one or more values (`--val_paths a b`, nanochat.dataset import's PATHS)
        self.env = env  # an environment variable that, when set, replaces the default
        if env:
            self.help += f" Default: ${env} when set."
        # words a number flag takes besides numbers, kept as the word: --resume_from_step is an int or `auto`
        self.words = tuple(words)
        if many and default is not None:
            raise ValueError(f"flag --{name}: a flag of many values defaults to None (auto or none given)")
        if self.choices is not None and default is not None and default not in self.choices:
            raise ValueError(f"flag --{name}: default {default!r} is not among its choices {self.choices}")

    def convert(self, raw):
        """The typed value of the command-line text `raw` (FlagError naming the flag and what it expects)."""
        name = self.display_name()
        low = raw.strip().lower()
        # auto: `auto`, or an empty value where that was the old spelling of auto (--device_type=); a free-form
        # string keeps "" (chat_web's --api_key= means "no key", not "the key in the environment")
        if self.default is None and (low == "auto" or (low == "" and self.choices is not None)):
            if self.required:
                raise FlagError(f"{name} is required: pass a value")
            return None
        if low in self.words:
            value = low
        elif self.type is bool:
            if low in _TRUE:
                value = True
            elif low in _FALSE:
                value = False
            else:
                raise FlagError(f"{name} expects a boolean (1/0/true/false), got {raw!r}")
        elif self.type is int:
            try:
                value = int(raw)
            except ValueError:
                try:
                    f = float(raw)  # allow 1e6 style for integer flags when it is a whole number
                except ValueError:
                    raise FlagError(f"{name} expects an integer{self._or_words()}, got {raw!r}") from None
                if f != int(f):
                    raise FlagError(f"{name} expects an integer{self._or_words()}, got {raw!r}")
                value = int(f)
        elif self.type is float:
            try:
                value = float(raw)
            except ValueError:
                raise FlagError(f"{name} expects a number{self._or_words()}, got {raw!r}") from None
        else:
            value = raw
        if self.choices is not None and value not in self.choices:
            raise FlagError(f"{name} must be one of {'|'.join(map(str, self.choices))}, got {raw!r}")
        self.check_range(value, raw)
        if self.check is not None:
            try:
                self.check(value)
            except ValueError as e:
                raise FlagError(str(e)) from None
        return value

    def initial(self):
        """The value before the command line: $env when set (converted and checked like a command-line value, an
        error naming the variable), else the default."""
        raw = os.environ.get(self.env, "").strip() if self.env else ""
        if not raw:
            return self.default
        try:
            return self.convert(raw)
        except FlagError as e:
            raise FlagError(f"{self.env}={raw} (the default of --{self.name}): {e}") from None

    def _or_words(self):
        return "".join(f" or {w}" for w in self.words)

    def check_range(self, value, raw):
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        low, high = self.min, self.max
        if (low is not None and value < low) or (high is not None and value > high):
            raise FlagError(f"{self.display_name()} must be{self.range_text(words=True)}, got {raw}")

    def range_text(self, words=False):
        """The bounds: ` 0..1` / ` >= 1` in --help, ` between 0 and 1` / ` >= 1` in an error."""
        low, high = (f"{v:g}" if isinstance(v, float) else v for v in (self.min, self.max))
        if self.min is not None and self.max is not None:
            return f" between {low} and {high}" if words else f" {low}..{high}"
        if self.min is not None:
            return f" >= {low}"
        return f" <= {high}" if self.max is not None else ""

    def display_name(self):
        return self.name.upper() if self.positional else f"--{self.name}"

    def help_lines(self, width=100):
        if self.positional:
            head = f"  {self.name.upper()}"
        else:
            head = f"  {'-' + self.short + ', ' if self.short else ''}--{self.name}"
            head += " (required)" if self.required else f"={format_value(self.default)}"
        if self.choices:
            auto = ["auto"] if self.default is None and not self.required else []
            kind = " | ".join(auto + [format_value(c) for c in self.choices])
        else:
            kind = _TYPE_NAMES[self.type] + self.range_text() + "".join(f" | {w}" for w in self.words)
        lines = [f"{head}  [{kind}{' ...' if self.many else ''}]"]
        lines += textwrap.wrap(self.help, width=width, initial_indent=" " * 6, subsequent_indent=" " * 6)
        return lines


def builtin_type(value):
    for t in (bool, int, float, str):  # bool before int: True is an int too
        if isinstance(value, t):
            return t
    raise ValueError(f"flag defaults must be bool, int, float, str or None, got {value!r}")


def format_value(value):
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "1" if value else "0"
    if value == "":
        return '""'
    return str(value)


class Config(dict):
    """The parsed flags: a plain dict (config["depth"]; checkpoints store dict(config)), also read as config.depth."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"no flag named {key!r}") from None

    def __setattr__(self, key, value):
        self[key] = value


class Rule:
    """
    A relation between flags, declared with them and checked after parsing (skipped while one of them is auto):
    Rule(("warmup_ratio", "warmdown_ratio"), lambda up, down: up + down <= 1,
         "--warmup_ratio + --warmdown_ratio must be <= 1 (got {warmup_ratio} + {warmdown_ratio})")
    The message is formatted with the parsed flags; it names them and the way out. --help lists the rules (their
    message up to " (got ").
    """

    def __init__(self, names, test, message):
        self.names, self.test, self.message = tuple(names), test, message

    def check(self, config):
        values = [config.get(n) for n in self.names]
        if any(v is None for v in values):
            return
        if not self.test(*values):
            raise FlagError(self.message.format(**config))


class Flags:
    """
    An ordered set of Flag. Items: Flag, a string (a heading for the flags after it in --help), a Rule, or a list of
    those (so shared lists such as nanochat.training.run_flags() splice in).
    """

    def __init__(self, *items, description=None, prog=None):
        self.description, self.prog = description, prog
        self.items = []  # Flag or heading str, in order
        self.by_name, self.by_short = {}, {}
        self.rules = []
        self._add(items)
        for rule in self.rules:
            unknown = [n for n in rule.names if n not in self.by_name]
            if unknown:
                raise ValueError(f"a rule names flags that are not declared: {unknown}")

    def _add(self, items):
        for item in items:
            if isinstance(item, (list, tuple)):
                self._add(item)
            elif isinstance(item, str):
                self.items.append(item)
            elif isinstance(item, Rule):
                self.rules.append(item)
            elif isinstance(item, Flag):
                if item.name in self.by_name:
                    raise ValueError(f"flag --{item.name} is declared twice")
                if item.short and item.short in self.by_short:
                    raise ValueError(f"short flag -{item.short} is declared twice")
                self.items.append(item)
                self.by_name[item.name] = item
                if item.short:
                    self.by_short[item.short] = item
            else:
                raise TypeError(f"Flags takes Flag, Rule, a heading string or a list of them, got {item!r}")

    @classmethod
    def from_defaults(cls, defaults):
        """The old style, a dict of defaults: every flag typed by its default (help: its default only)."""
        return cls(*[Flag(k, v, f"(default {format_value(v)})", type=None if v is not None else str)
                     for k, v in defaults.items()])

    def flags(self):
        return [f for f in self.items if isinstance(f, Flag)]

    def defaults(self):
        """{name: default}: what a run with no flags gets (None = auto)."""
        return {f.name: f.default for f in self.flags() if not f.positional}

    def __contains__(self, name):
        return name in self.by_name

    def __getitem__(self, name):
        return self.by_name[name]

    # ------------------------------------------------------------------ help

    def usage(self, prog=None):
        prog = prog or self.prog or _prog_name()
        positional = " ".join(f.name.upper() for f in self.flags() if f.positional)
        required = " ".join(f"--{f.name}=VALUE" for f in self.flags() if f.required and not f.positional)
        return "usage: " + " ".join(p for p in (prog, positional, required, "[--flag=value ...]") if p)

    def help_text(self, prog=None, description=None):
        description = description if description is not None else self.description
        lines = [self.usage(prog), ""]
        if description:
            lines += [description.strip("\n"), ""]
        lines.append("Flags: --name=value or --name value; --a_b and --a-b are the same flag; auto = worked out by "
                     "the script. Booleans: 1/0/true/false.")
        for item in self.items:
            if isinstance(item, str):
                lines += ["", f"{item}:"]
            elif not item.hidden:
                lines += item.help_lines()
        if self.rules:
            lines += ["", "Checked together:"]
            lines += [f"      {r.message.split(' (got ')[0]}" for r in self.rules]  # the message without its values
        return "\n".join(lines) + "\n"

    def error(self, message, prog=None):
        """argparse's parser.error, as one line: `error: message` on stderr, exit status 2 (nanochat/usage.py)."""
        exit_with(FlagError(message))

    # ------------------------------------------------------------------ parsing

    def parse(self, argv=None, prog=None, description=None):
        """A Config of every flag: defaults overridden by argv (sys.argv[1:] by default). FlagError on a bad flag;
        --help/-h prints the help and exits with status 0."""
        argv = list(sys.argv[1:] if argv is None else argv)
        config = Config()
        for f in self.flags():
            config[f.name] = f.initial()
        positionals = [f for f in self.flags() if f.positional]
        given = set()
        i = 0
        while i < len(argv):
            arg = argv[i]
            i += 1
            if arg == "--":  # `torchrun -m scripts.x -- --flag=v` may hand the separator through
                continue
            if arg in ("-h", "--help"):
                sys.stdout.write(self.help_text(prog, description))
                sys.exit(0)
            if arg.startswith("--"):
                key, eq, raw = arg[2:].partition("=")
                key = key.replace("-", "_")
                flag = self.by_name.get(key)
                if flag is None or flag.positional:
                    raise FlagError(f"unknown flag --{key}.{self._suggest(key)} Run with --help to list the flags.")
            elif arg.startswith("-") and len(arg) > 1 and not _is_number(arg):
                flag = self.by_short.get(arg[1])
                if flag is None:
                    raise FlagError(f"unknown flag {arg[:2]}.{self._suggest(arg[1:].lstrip('-'))} Run with --help to "
                                    f"list the flags.")
                rest = arg[2:]
                eq, raw = ("=", rest[1:] if rest.startswith("=") else rest) if rest else ("", "")
            else:
                if not positionals:
                    raise FlagError(f"unexpected argument {arg!r}: flags look like --name=value or --name value")
                flag = positionals[0]
                if flag.many:  # takes every positional value from here on, wherever it stands between flags
                    config[flag.name] = (config[flag.name] if flag.name in given else []) + [flag.convert(arg)]
                else:
                    positionals.pop(0)
                    config[flag.name] = flag.convert(arg)
                given.add(flag.name)
                continue
            if flag.many:  # --val_paths a b c: the values up to the next flag
                values = [raw] if eq else []
                while not eq and i < len(argv) and not (argv[i].startswith("-") and not _is_number(argv[i])):
                    values.append(argv[i])
                    i += 1
                if not values:
                    raise FlagError(f"flag --{flag.name} needs one or more values (--{flag.name} A B ...)")
                config[flag.name] = [flag.convert(v) for v in values]
                given.add(flag.name)
                continue
            if not eq:
                nxt = argv[i] if i < len(argv) else None
                if flag.type is bool:  # `--fp8` alone means on; `--fp8 0` still reads the value
                    if nxt is not None and nxt.strip().lower() in _TRUE | _FALSE:
                        raw = nxt
                        i += 1
                    else:
                        raw = "1"
                elif nxt is None:
                    raise FlagError(f"flag --{flag.name} needs a value (--{flag.name}=VALUE)")
                else:
                    raw = nxt
                    i += 1
            config[flag.name] = flag.convert(raw)
            given.add(flag.name)
        missing = [f.display_name() for f in self.flags() if f.required and f.name not in given]
        if missing:
            raise FlagError(f"missing required {', '.join(missing)} (run with --help for what each means)")
        for rule in self.rules:
            rule.check(config)
        return config

    def parse_args(self, argv=None, prog=None, description=None):
        """argparse's contract, for the CLIs that were argparse: a bad flag prints the error, exit status 2."""
        try:
            return self.parse(argv, prog=prog, description=description)
        except FlagError as e:
            self.error(str(e), prog)

    def _suggest(self, key):
        return suggest(key, [f.name for f in self.flags() if not f.positional and not f.hidden])


def suggest(key, names):
    """" Did you mean: --a, --b?" for the names close to `key` ("" when none is): the hint after an unknown flag, here
    and in the shell launchers (scripts/lib.sh's suggest_flag)."""
    close = difflib.get_close_matches(key, names, n=3)
    return f" Did you mean: {', '.join('--' + c for c in close)}?" if close else ""


def _is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def _prog_name(prog=None):
    if prog:
        return prog
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name}"
    return f"python {sys.argv[0]}" if sys.argv and sys.argv[0] else "python"


def _as_flags(flags):
    return flags if isinstance(flags, Flags) else Flags.from_defaults(flags)


def parse_flags(flags, argv=None, prog=None, description=None):
    """A Config (a dict) of `flags` (a Flags, or a dict of defaults) overridden by argv (sys.argv[1:] by default)."""
    return _as_flags(flags).parse(argv, prog=prog, description=description)


def parse_flags_or_exit(flags, argv=None, description=None, prog=None):
    """
    parse_flags for entrypoints: a bad flag prints the message and exits with status 2.

    A launcher checks the flags it will pass to a script before it starts any work (pretrain.sh and base_train):
    with NANOCHAT_CHECK_FLAGS set, the script parses its flags, exits 0 if they are good, and runs nothing. The
    variable lists the launcher's own flags as name:type (`dry_run:bool num_shards:int`), accepted and suggested
    alongside the script's.
    """
    flags = _as_flags(flags)
    check = os.environ.get("NANOCHAT_CHECK_FLAGS")
    if check is not None:
        types = {"bool": False, "int": 0, "float": 0.0, "str": ""}
        own = [Flag(n, types[t], "the launcher's own flag") for n, _, t in (s.partition(":") for s in check.split())
               if n not in flags]
        flags = Flags(flags.items, flags.rules, own, prog=flags.prog, description=flags.description)
    try:
        config = flags.parse(argv, prog=prog, description=description)
    except FlagError as e:
        exit_with(e)
    if check is not None:
        sys.exit(0)
    return config
