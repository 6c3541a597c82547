"""
The flag parser every entry point uses (nanochat/configurator.py): the accepted spellings, help text, choices, auto
(None) values, booleans, short and positional flags; and `--help` of every script and benchmark.
"""

import importlib
import re
import subprocess
import sys

import pytest

from nanochat.configurator import Config, Flag, FlagError, Flags, parse_flags, parse_flags_or_exit
from conftest import REPO

FLAGS = Flags(
    "model",
    Flag("depth", 20, "transformer blocks"),
    Flag("device_batch_size", 32, "rows per forward pass"),
    Flag("matrix_lr", 0.02, "learning rate of the matrices"),
    Flag("eval_tokens", None, "tokens per validation; auto = a few batches on CPU", type=int),
    "systems",
    Flag("use_muon", True, "Muon for the matrices"),
    Flag("source", "sft", "which checkpoints to load", choices=["base", "mid", "sft", "rl"], short="i"),
    Flag("model_tag", None, "model tag; auto = the largest", type=str, short="g"),
    Flag("run", "dummy", "wandb run name"),
)


def test_both_spellings_and_types():
    c = FLAGS.parse(["--depth=4", "--device-batch-size", "8", "--matrix_lr", "1e-3", "--run=x", "--use-muon=0"])
    assert c == {"depth": 4, "device_batch_size": 8, "matrix_lr": 1e-3, "eval_tokens": None, "use_muon": False,
                 "source": "sft", "model_tag": None, "run": "x"}
    assert isinstance(c, dict) and isinstance(c, Config) and c.depth == 4 and c["depth"] == 4
    assert dict(c) == c  # what checkpoints store as user_config: a plain dict of the same keys
    assert FLAGS.parse(["--depth=1e2"])["depth"] == 100  # whole numbers in e-notation are fine for ints
    assert FLAGS.parse(["--", "--depth=3"])["depth"] == 3  # torchrun may hand `--` through
    assert FLAGS.parse(["--matrix_lr", "-1"])["matrix_lr"] == -1.0  # a negative value after the flag is its value
    assert FLAGS.parse([]) == FLAGS.defaults()


def test_bad_values_and_unknown_flags_name_what_to_use():
    with pytest.raises(FlagError, match=r"unknown flag --dept\. Did you mean: --depth\?"):
        FLAGS.parse(["--dept=4"])
    with pytest.raises(FlagError, match="--depth expects an integer, got 'four'"):
        FLAGS.parse(["--depth=four"])
    with pytest.raises(FlagError, match="--depth expects an integer"):
        FLAGS.parse(["--depth=2.5"])
    with pytest.raises(FlagError, match="--matrix_lr expects a number"):
        FLAGS.parse(["--matrix_lr=fast"])
    with pytest.raises(FlagError, match=r"--depth needs a value \(--depth=VALUE\)"):
        FLAGS.parse(["--depth"])
    with pytest.raises(FlagError, match="unexpected argument 'extra'"):
        FLAGS.parse(["extra"])
    with pytest.raises(FlagError, match="unknown flag -z"):
        FLAGS.parse(["-z", "1"])


def test_choices_are_checked_with_the_list():
    assert FLAGS.parse(["--source=base"])["source"] == "base"
    with pytest.raises(FlagError, match=r"--source must be one of base\|mid\|sft\|rl, got 'chat'"):
        FLAGS.parse(["--source=chat"])
    with pytest.raises(ValueError, match="not among its choices"):
        Flag("x", "c", "help", choices=["a", "b"])


def test_auto_values():
    assert FLAGS.parse([])["eval_tokens"] is None
    assert FLAGS.parse(["--eval_tokens=auto"])["eval_tokens"] is None
    assert FLAGS.parse(["--eval_tokens", "AUTO"])["eval_tokens"] is None
    device = Flags(Flag("device_type", None, "cuda | cpu; auto = detect", type=str, choices=["cuda", "cpu"]))
    assert device.parse(["--device_type="])["device_type"] is None  # the old empty spelling of autodetect still works
    assert device.parse(["--device_type=auto"])["device_type"] is None
    assert FLAGS.parse(["--model_tag="])["model_tag"] == ""  # a free-form string keeps an explicit empty value
    assert FLAGS.parse(["--eval_tokens=1024"])["eval_tokens"] == 1024
    with pytest.raises(FlagError, match="--eval_tokens expects an integer"):
        FLAGS.parse(["--eval_tokens=lots"])
    with pytest.raises(ValueError, match="needs an explicit type"):
        Flag("x", None, "an auto flag without a type")


def test_booleans():
    for raw, want in [("1", True), ("0", False), ("true", True), ("False", False), ("yes", True), ("off", False)]:
        assert FLAGS.parse([f"--use_muon={raw}"])["use_muon"] is want
        assert FLAGS.parse(["--use_muon", raw])["use_muon"] is want
    assert FLAGS.parse(["--use_muon"])["use_muon"] is True  # a bare boolean flag switches it on
    assert FLAGS.parse(["--use_muon", "--depth=3"]) == dict(FLAGS.defaults(), use_muon=True, depth=3)
    with pytest.raises(FlagError, match=r"--use_muon expects a boolean \(1/0/true/false\), got 'maybe'"):
        FLAGS.parse(["--use_muon=maybe"])


def test_short_and_positional_flags():
    flags = Flags(
        Flag("dir", None, "the model directory", type=str, positional=True, required=True),
        Flag("source", None, "stage", type=str, choices=["base", "sft"], short="i", required=True),
        Flag("step", 0, "step number", short="s"),
    )
    assert flags.parse(["hf/d20", "-i", "sft"]) == {"dir": "hf/d20", "source": "sft", "step": 0}
    assert flags.parse(["--source", "base", "-s", "7", "x"]) == {"dir": "x", "source": "base", "step": 7}
    assert flags.parse(["-ibase", "-s=3", "x"]) == {"dir": "x", "source": "base", "step": 3}
    with pytest.raises(FlagError, match="missing required --source"):
        flags.parse(["x"])
    with pytest.raises(FlagError, match="missing required DIR"):
        flags.parse(["-i", "sft"])
    with pytest.raises(FlagError, match="unexpected argument 'y'"):
        flags.parse(["x", "y", "-i", "sft"])


def test_flags_of_many_values():
    """nanochat.dataset import's PATHS ... and --val_paths A B: lists, wherever the positional values stand."""
    flags = Flags(
        Flag("paths", None, "input files", type=str, positional=True, required=True, many=True),
        Flag("val_paths", None, "validation files", type=str, many=True),
        Flag("val_docs", None, "held-out documents", type=int),
    )
    assert flags.parse(["a", "b"]) == {"paths": ["a", "b"], "val_paths": None, "val_docs": None}
    c = flags.parse(["a", "--val_paths", "v1", "v2", "--val-docs", "3", "b"])
    assert c == {"paths": ["a", "b"], "val_paths": ["v1", "v2"], "val_docs": 3}
    assert flags.parse(["a", "--val_paths=v"])["val_paths"] == ["v"]
    with pytest.raises(FlagError, match="--val_paths needs one or more values"):
        flags.parse(["a", "--val_paths", "--val_docs=2"])
    with pytest.raises(FlagError, match="missing required PATHS"):
        flags.parse(["--val_docs=2"])


def test_declaration_errors():
    with pytest.raises(ValueError, match="needs a help text"):
        Flag("x", 1, "")
    with pytest.raises(ValueError, match="declared twice"):
        Flags(Flag("x", 1, "a"), Flag("x", 2, "b"))
    with pytest.raises(ValueError, match="short alias"):
        Flag("x", 1, "a", short="h")


def test_help_shows_every_flag_with_type_default_and_text(capsys):
    with pytest.raises(SystemExit) as e:
        FLAGS.parse(["--help"], prog="python -m scripts.x", description="What x does.")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m scripts.x") and "What x does." in out
    assert "model:" in out and "systems:" in out
    assert "  --depth=20  [int]\n      transformer blocks" in out
    assert "  --eval_tokens=auto  [int]" in out
    assert "  --use_muon=1  [bool]" in out
    assert "  -i, --source=sft  [base | mid | sft | rl]" in out
    assert "  -g, --model_tag=auto  [str]" in out


def test_legacy_dict_of_defaults_and_exit_status(capsys):
    c = parse_flags({"depth": 20, "run": "dummy"}, ["--depth", "4"])
    assert c == {"depth": 4, "run": "dummy"}
    with pytest.raises(SystemExit) as e:
        parse_flags_or_exit(FLAGS, ["--depht=3"])
    assert e.value.code == 2 and "Did you mean: --depth?" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # the argparse contract of the CLIs that were argparse, as one line
        FLAGS.parse_args(["--source=chat"])
    assert e.value.code == 2 and capsys.readouterr().err == "error: --source must be one of base|mid|sft|rl, got 'chat'\n"


def test_explicit_eval_tokens_equal_to_the_old_default_are_honoured_on_cpu():
    """auto (None) is cut to a few batches on CPU; a number the user passes is used even when it equals the default."""
    from nanochat.training import CPU_EVAL_STEPS, DEFAULT_EVAL_TOKENS, eval_steps_for

    per_batch = 4 * 256
    assert eval_steps_for(None, per_batch, "cpu") == CPU_EVAL_STEPS
    assert eval_steps_for(DEFAULT_EVAL_TOKENS, per_batch, "cpu") == DEFAULT_EVAL_TOKENS // per_batch
    assert eval_steps_for(None, per_batch, "cuda") == DEFAULT_EVAL_TOKENS // per_batch
    assert eval_steps_for(None, per_batch, "cpu", enabled=False) == 0


def test_core_max_per_task_auto_on_cpu_only_when_not_given(monkeypatch):
    """base_train: --core_metric_max_per_task=500 on CPU stays 500 (it used to be replaced because it equalled the
    default); auto becomes the CPU value."""
    from scripts import base_train

    assert base_train.FLAGS.parse([])["core_metric_max_per_task"] is None
    explicit = base_train.FLAGS.parse([f"--core_metric_max_per_task={base_train.CORE_MAX_PER_TASK}"])
    assert explicit["core_metric_max_per_task"] == base_train.CORE_MAX_PER_TASK
    assert base_train.FLAGS.parse([])["eval_tokens"] is None


# ----------------------------------------------------------------------------------------------------------------
# --help of every entry point

ENTRY_POINTS = sorted(
    [(f"scripts.{p.stem}", ["--help"]) for p in (REPO / "scripts").glob("*.py") if p.stem != "__init__"]
    + [(f"bench.{p.stem}", ["--help"]) for p in (REPO / "bench").glob("*.py")
       if p.stem != "decode_driver" and 'if __name__ == "__main__"' in p.read_text()]  # entry points, not helpers
    + [("nanochat.dataset", ["--help"]), ("nanochat.dataset", ["import", "--help"]),
       ("nanochat.setup_check", ["--help"]), ("nanochat.presets", ["--help"])]
)  # bench/decode_driver.py stays argparse on purpose: it runs unchanged against the reference nanochat's tree


def check_help(out):
    """Every flag line (after the description) is followed by an indented, non-empty help text."""
    lines = out.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("Flags: --name=value")):]
    flag_lines = [i for i, line in enumerate(lines) if line.startswith("  -") or (line.startswith("  ") and
                                                                               line[2:3].isupper() and "[" in line)]
    assert flag_lines, out
    for i in flag_lines:
        assert i + 1 < len(lines) and lines[i + 1].startswith("      ") and lines[i + 1].strip(), lines[i]
    return len(flag_lines)


@pytest.mark.parametrize("module,argv", ENTRY_POINTS, ids=[" ".join([m, *a]) for m, a in ENTRY_POINTS])
def test_every_entry_point_explains_its_flags(module, argv, capsys):
    """In process (one torch import for all): main([..., "--help"]) exits 0 and every flag has a help text."""
    mod = importlib.import_module(module)
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    assert check_help(out) >= 1  # at least one flag found, each with its help


def help_flags(entry, sub, capsys):
    """The flag names an entry point's --help lists (long names, and the letters of short ones)."""
    if entry.endswith(".sh"):  # the launchers' flags are scripts/launch.py's; run1000.sh is speedrun.sh at d32
        module, argv = "scripts.launch", ["speedrun.sh" if entry == "run1000.sh" else entry, "--help"]
    else:
        module, argv = entry, [*sub, "--help"]
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert e.value.code == 0, (entry, sub)
    out = capsys.readouterr().out
    names = set(re.findall(r"^  (?:-\w, )?--(\w+)", out, re.M)) | set(re.findall(r"^  -(\w), --", out, re.M))
    return names | ({"h", "help"} if names else set())


def test_every_flag_the_docs_show_exists(capsys):
    """Each `python -m X --flag` / `bash launcher.sh --flag` in README.md and docs/*.md names a flag that entry point
    takes (pretrain.sh passes the flags it does not know on to base_train, which checks them)."""
    from test_docs import doc_commands  # tests/architecture is on pytest's pythonpath
    known, wrong = {}, []
    for page, entry, sub, flags in doc_commands():
        key = (entry, tuple(sub))
        if flags and key not in known:
            known[key] = help_flags(entry, sub, capsys)
            if entry == "pretrain.sh":
                known[key] |= help_flags("scripts.base_train", [], capsys)
        wrong += [f"{page}: {' '.join([entry, *sub])} {'-' if len(f) == 1 else '--'}{f}"
                  for f in flags if f not in known.get(key, ())]
    assert len(known) > 20
    assert not wrong, "flags the docs show that the command does not take:\n" + "\n".join(wrong)


@pytest.mark.slow
def test_help_from_the_command_line():
    """The real CLI path: `python -m scripts.base_train --help` in a subprocess, both flag spellings of a bad value."""
    p = subprocess.run([sys.executable, "-m", "scripts.base_train", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "usage: python -m scripts.base_train" in p.stdout and "--core_metric_max_per_task=auto" in p.stdout
    check_help(p.stdout)
    p = subprocess.run([sys.executable, "-m", "scripts.chat_cli", "--device-type", "tpu"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--device_type must be one of cuda|cpu|mps, got 'tpu'" in p.stderr


def test_ranges_and_rules_are_declared_with_the_flags_and_shown_in_help():
    from nanochat.configurator import Rule

    flags = Flags(
        Flag("ratio", 0.2, "a fraction", min=0.0, max=1.0),
        Flag("other", None, "a fraction or auto", type=float, min=0.0, max=1.0),
        Flag("steps", 10, "at least one", min=1),
        Rule(("ratio", "other"), lambda a, b: a + b <= 1, "--ratio + --other must be <= 1 (got {ratio} + {other})"),
    )
    assert parse_flags(flags, ["--ratio=1", "--steps=1"]) == {"ratio": 1.0, "other": None, "steps": 1}  # auto skips
    for argv, message in [(["--ratio=1.5"], "--ratio must be between 0 and 1, got 1.5"),
                          (["--steps=0"], "--steps must be >= 1, got 0"),
                          (["--ratio=0.6", "--other=0.5"], "--ratio + --other must be <= 1 (got 0.6 + 0.5)")]:
        with pytest.raises(FlagError) as e:
            parse_flags(flags, argv)
        assert str(e.value) == message
    text = flags.help_text(prog="x")
    assert "--ratio=0.2  [float 0..1]" in text and "--steps=10  [int >= 1]" in text
    assert text.endswith("Checked together:\n      --ratio + --other must be <= 1\n")
    with pytest.raises(ValueError, match="not declared"):
        Flags(Flag("a", 1, "a"), Rule(("a", "b"), lambda a, b: True, "never"))


def test_check_flags_mode_parses_then_stops(monkeypatch, capsys):
    """NANOCHAT_CHECK_FLAGS (pretrain.sh's check of the flags it passes to base_train): good flags exit 0 before the
    script does anything, the launcher's own names are accepted and suggested, a mistake is the usual one line."""
    monkeypatch.setenv("NANOCHAT_CHECK_FLAGS", "dry_run:bool num_shards:int")
    with pytest.raises(SystemExit) as e:
        parse_flags_or_exit(FLAGS, ["--depth=4", "--dry_run", "--num_shards=3"])
    assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        parse_flags_or_exit(FLAGS, ["--dryrun"])
    assert e.value.code == 2 and "Did you mean: --dry_run" in capsys.readouterr().err
    monkeypatch.delenv("NANOCHAT_CHECK_FLAGS")
    assert parse_flags_or_exit(FLAGS, ["--depth=4"])["depth"] == 4  # and without it, parsing returns as always
