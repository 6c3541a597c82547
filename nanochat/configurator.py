"""
Command-line flags for the training and eval scripts, nanochat style.

Each script declares its settings as a dict of defaults; `parse_flags` overrides them from argv.
Accepted forms: `--depth=20`, `--depth 20`, `--device-batch-size=32`, `--device_batch_size 32`.
The type of each flag is the type of its default. Unknown flags are errors that list close matches.
"""

import argparse
import difflib
import sys


class FlagError(ValueError):
    pass


_TRUE = {"1", "true", "yes", "on", "t", "y"}
_FALSE = {"0", "false", "no", "off", "f", "n"}


def _convert(name, raw, default):
    if isinstance(default, bool):
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise FlagError(f"--{name} expects a boolean (1/0/true/false), got {raw!r}")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            try:
                f = float(raw)  # allow 1e6 style for integer flags when it is a whole number
            except ValueError:
                raise FlagError(f"--{name} expects an integer, got {raw!r}") from None
            if f != int(f):
                raise FlagError(f"--{name} expects an integer, got {raw!r}")
            return int(f)
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise FlagError(f"--{name} expects a number, got {raw!r}") from None
    return raw  # str or None default: keep the string


def parse_flags(defaults, argv=None, prog=None, description=None):
    """Return a new dict: `defaults` overridden by the flags in argv (sys.argv[1:] by default)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config = dict(defaults)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":  # `torchrun -m scripts.x -- --flag=v` may hand the separator through
            i += 1
            continue
        if arg in ("-h", "--help"):
            lines = [description or "", "flags (default):"]
            lines += [f"  --{k}={v!r}" for k, v in defaults.items()]
            print("\n".join(lines))
            sys.exit(0)
        if not arg.startswith("--"):
            raise FlagError(f"unexpected argument {arg!r}: flags look like --name=value or --name value")
        body = arg[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        else:
            key = body
            if i + 1 >= len(argv):
                raise FlagError(f"flag --{key} needs a value (--{key}=VALUE)")
            raw = argv[i + 1]
            i += 1
        key = key.replace("-", "_")
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults), n=3)
            hint = f" Did you mean: {', '.join('--' + c for c in close)}?" if close else ""
            raise FlagError(f"unknown flag --{key}.{hint} Run with --help to list the flags.")
        config[key] = _convert(key, raw, defaults[key])
        i += 1
    return config


def parse_flags_or_exit(defaults, argv=None, description=None):
    """parse_flags for entrypoints: a bad flag prints the message and exits with status 2."""
    try:
        return parse_flags(defaults, argv, description=description)
    except FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def add_dashed_aliases(parser: argparse.ArgumentParser):
    """For argparse-based scripts: accept --a-b as well as --a_b for every long option."""
    for action in list(parser._actions):
        extra = []
        for opt in action.option_strings:
            if opt.startswith("--") and "_" in opt[2:]:
                alias = "--" + opt[2:].replace("_", "-")
                if alias not in parser._option_string_actions:
                    extra.append(alias)
        for alias in extra:
            action.option_strings.append(alias)
            parser._option_string_actions[alias] = action
    return parser
