"""
The report card. Each stage logs a section (a small markdown file under <base_dir>/report/) and curves (JSON);
`python -m nanochat.report generate` assembles report.md with system and git info, code size, a cost estimate, every
stage's section, the BASE/MID/SFT/RL summary table and the loss / bpb curves drawn as PNG images next to it.

    python -m nanochat.report reset      # start a new report (header with system info)
    python -m nanochat.report generate   # write <base_dir>/report/report.md (and copy it to ./report.md)
"""

import datetime
import json
import os
import platform
import re
import socket
import subprocess
import sys

from nanochat.atomic import atomic_write
from nanochat.common import get_base_dir, get_dist_info
from nanochat.usage import BadValue, exit_with

# The order sections appear in the report (others are appended after these, in file-name order).
SECTION_ORDER = [
    "Tokenizer training",
    "Tokenizer evaluation",
    "Base model training",
    "Base model loss",
    "Base model evaluation",
    "Midtraining",
    "Chat evaluation mid",
    "Chat SFT",
    "Chat evaluation sft",
    "Chat RL",
    "Chat evaluation rl",
]

# Metrics of the summary table, with the labels they may be logged under.
SUMMARY_METRICS = [
    ("CORE", ["CORE metric", "core_metric", "CORE"]),
    ("ARC-Challenge", ["ARC-Challenge"]),
    ("ARC-Easy", ["ARC-Easy"]),
    ("GSM8K", ["GSM8K"]),
    ("HumanEval", ["HumanEval"]),
    ("MMLU", ["MMLU"]),
    ("SpellingBee", ["SpellingBee"]),
    ("ChatCORE", ["ChatCORE metric", "ChatCORE"]),
]
STAGE_SECTIONS = {
    "BASE": ["Base model evaluation"],
    "MID": ["Chat evaluation mid"],
    "SFT": ["Chat evaluation sft"],
    "RL": ["Chat evaluation rl"],
}

# rough on-demand price per GPU-hour, for the cost estimate
GPU_HOURLY_USD = [("H100", 3.00), ("H200", 3.50), ("A100", 1.80), ("B200", 5.00)]


def slugify(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_info():
    commit = _run(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    branch = _run(["git", "rev-parse", "--abbrev-ref", "HEAD"]) or "unknown"
    dirty = bool(_run(["git", "status", "--porcelain"]))
    message = _run(["git", "log", "-1", "--pretty=%s"])
    return {"commit": commit, "branch": branch, "dirty": dirty, "message": message}


def gpu_info():
    try:
        import torch

        if not torch.cuda.is_available():
            return {"available": False}
        n = torch.cuda.device_count()
        names = [torch.cuda.get_device_name(i) for i in range(n)]
        mem = [torch.cuda.get_device_properties(i).total_memory / 1024**3 for i in range(n)]
        return {"available": True, "count": n, "names": names, "memory_gb": mem, "cuda": torch.version.cuda}
    except Exception as e:  # a broken driver should not stop the report
        return {"available": False, "error": str(e)}


def system_info():
    import psutil

    info = {
        "hostname": socket.gethostname(),
        "platform": platform.system(),
        "python": sys.version.split()[0],
        "cpu_count": psutil.cpu_count(logical=False),
        "cpu_count_logical": psutil.cpu_count(logical=True),
        "memory_gb": psutil.virtual_memory().total / 1024**3,
        "user": os.environ.get("USER", "unknown"),
        "world_size": get_dist_info()[3],
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def code_size(root="."):
    """Lines/characters of the project's own source (what a reader has to read)."""
    exts = (".py", ".rs", ".sh", ".html", ".md", ".toml")
    files = _run(["git", "ls-files"]).splitlines() if os.path.isdir(os.path.join(root, ".git")) else []
    stats = {"files": 0, "lines": 0, "chars": 0}
    for f in files:
        if f.endswith(exts) and os.path.isfile(f):
            with open(f, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            stats["files"] += 1
            stats["lines"] += text.count("\n")
            stats["chars"] += len(text)
    return stats


def cost_estimate(gpu, hours):
    if not gpu.get("available"):
        return None
    rate = next((r for key, r in GPU_HOURLY_USD if key in gpu["names"][0]), None)
    if rate is None:
        return None
    return rate * gpu["count"] * hours


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def extract_metrics(section_text):
    """key: value pairs from '- key: value' lines of a section."""
    out = {}
    for line in section_text.splitlines():
        m = re.match(r"^- ([^:]+): (.*)$", line.strip())
        if m:
            out[m.group(1).strip()] = m.group(2).strip()
    return out


class Report:
    def __init__(self, report_dir):
        self.report_dir = report_dir
        os.makedirs(report_dir, exist_ok=True)

    def _write(self, path, text):
        atomic_write(path, lambda f: f.write(text.encode("utf-8")))

    def log(self, section, data):
        """Write one section: data is a list of dicts (rendered as '- key: value') and strings (verbatim)."""
        lines = [f"## {section}", f"timestamp: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}", ""]
        for item in data:
            if not item:
                continue
            if isinstance(item, str):
                lines.append(item)
            else:
                for k, v in item.items():
                    if isinstance(v, (list, tuple)) and v and all(isinstance(s, str) for s in v):
                        lines.append(f"- {k}:")
                        lines.extend(f"    - {s!r}" for s in v)
                    else:
                        lines.append(f"- {k}: {_fmt(v)}")
            lines.append("")
        path = os.path.join(self.report_dir, f"{slugify(section)}.md")
        self._write(path, "\n".join(lines) + "\n")
        return path

    def log_curve(self, name, xs, ys, xlabel="step", ylabel=""):
        """Save a curve (e.g. the training loss) to be plotted by generate()."""
        path = os.path.join(self.report_dir, f"curve-{slugify(name)}.json")
        self._write(path, json.dumps({"name": name, "x": list(xs), "y": list(ys), "xlabel": xlabel, "ylabel": ylabel}))
        return path

    def reset(self):
        """Delete every logged section and curve, and write a fresh header."""
        for f in os.listdir(self.report_dir):
            if f.endswith((".md", ".json", ".png")):
                os.remove(os.path.join(self.report_dir, f))
        gpu = gpu_info()
        sysi = system_info()
        git = git_info()
        code = code_size()
        lines = ["# nanochat training report", "", f"Generated: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}", "",
                 "## Environment", "", "### Git", f"- Branch: {git['branch']}", f"- Commit: {git['commit']}" + (" (dirty)" if git["dirty"] else " (clean)"),
                 f"- Message: {git['message']}", "", "### Hardware", f"- Platform: {sysi['platform']}",
                 f"- CPUs: {sysi['cpu_count']} cores ({sysi['cpu_count_logical']} logical)", f"- Memory: {sysi['memory_gb']:.1f} GB"]
        if gpu.get("available"):
            lines += [f"- GPUs: {gpu['count']}x {gpu['names'][0]}", f"- GPU memory: {sum(gpu['memory_gb']):.1f} GB total", f"- CUDA: {gpu['cuda']}"]
        else:
            lines += ["- GPUs: none"]
        lines += ["", "### Software", f"- Python: {sysi['python']}", f"- PyTorch: {sysi.get('torch', 'not installed')}", "",
                  "### Code", f"- Files: {code['files']}", f"- Lines: {code['lines']:,}", f"- Characters: {code['chars']:,}", ""]
        self._write(os.path.join(self.report_dir, "header.md"), "\n".join(lines) + "\n")
        self._write(os.path.join(self.report_dir, "start_time.json"), json.dumps({"start": datetime.datetime.now().timestamp()}))

    def _sections(self):
        files = [f for f in os.listdir(self.report_dir) if f.endswith(".md") and f not in ("header.md", "report.md")]
        order = {slugify(s) + ".md": i for i, s in enumerate(SECTION_ORDER)}
        return sorted(files, key=lambda f: (order.get(f, len(order)), f))

    def plot_curves(self):
        curves = sorted(f for f in os.listdir(self.report_dir) if f.startswith("curve-") and f.endswith(".json"))
        if not curves:
            return []
        import matplotlib

        matplotlib.use("Agg")  # headless
        import matplotlib.pyplot as plt

        images = []
        for f in curves:
            with open(os.path.join(self.report_dir, f), encoding="utf-8") as fh:
                c = json.load(fh)
            if not c["x"]:
                continue
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(c["x"], c["y"], marker="o" if len(c["x"]) < 30 else None, markersize=3)
            ax.set_title(c["name"])
            ax.set_xlabel(c["xlabel"])
            ax.set_ylabel(c["ylabel"])
            ax.grid(alpha=0.3)
            fig.tight_layout()
            png = f[: -len(".json")] + ".png"
            fig.savefig(os.path.join(self.report_dir, png), dpi=100)
            plt.close(fig)
            images.append((c["name"], png))
        return images

    def summary_table(self):
        texts = {}
        for f in self._sections():
            with open(os.path.join(self.report_dir, f), encoding="utf-8") as fh:
                texts[f] = extract_metrics(fh.read())
        rows = []
        for label, keys in SUMMARY_METRICS:
            row = [label]
            for stage, sections in STAGE_SECTIONS.items():
                value = "-"
                for s in sections:
                    metrics = texts.get(slugify(s) + ".md", {})
                    for k in keys:
                        if k in metrics:
                            value = metrics[k]
                            break
                row.append(value)
            rows.append(row)
        lines = ["| Metric | BASE | MID | SFT | RL |", "|--------|------|-----|-----|----|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)

    def generate(self, copy_to_cwd=True):
        header_path = os.path.join(self.report_dir, "header.md")
        parts = []
        if os.path.exists(header_path):
            with open(header_path, encoding="utf-8") as fh:
                parts.append(fh.read())
        else:
            parts.append("# nanochat training report\n\n(no header: run `python -m nanochat.report reset` before training)\n")
        start_path = os.path.join(self.report_dir, "start_time.json")
        gpu = gpu_info()
        if os.path.exists(start_path):
            with open(start_path, encoding="utf-8") as fh:
                start = json.load(fh)["start"]
            hours = (datetime.datetime.now().timestamp() - start) / 3600
            cost = cost_estimate(gpu, hours)
            parts.append(f"## Cost\n\n- Wall clock since reset: {hours:.2f} h\n" +
                         (f"- Estimated cost: ${cost:.2f}\n" if cost is not None else "- Estimated cost: n/a (no priced GPU)\n"))
        parts.append("## Summary\n\n" + self.summary_table() + "\n")
        for f in self._sections():
            with open(os.path.join(self.report_dir, f), encoding="utf-8") as fh:
                parts.append(fh.read())
        images = self.plot_curves()
        if images:
            parts.append("## Curves\n\n" + "\n".join(f"![{name}]({png})" for name, png in images) + "\n")
        text = "\n".join(parts)
        out = os.path.join(self.report_dir, "report.md")
        self._write(out, text)
        if copy_to_cwd and os.path.abspath(".") != os.path.abspath(self.report_dir):
            # the copy in the working directory points its images at the report directory
            for name, png in images:
                text = text.replace(f"]({png})", f"]({os.path.join(self.report_dir, png)})")
            self._write("report.md", text)
        return out


class DummyReport:
    def log(self, *args, **kwargs):
        pass

    def log_curve(self, *args, **kwargs):
        pass

    def reset(self, *args, **kwargs):
        pass


def get_report():
    """The report on rank 0, a no-op elsewhere (only one process writes)."""
    if get_dist_info()[1] == 0:
        return Report(os.path.join(get_base_dir(), "report"))
    return DummyReport()


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "generate"
    if cmd == "reset":
        get_report().reset()
        print(f"Report reset in {os.path.join(get_base_dir(), 'report')}")
    elif cmd == "generate":
        path = get_report().generate()
        print(f"Report written to {path} (and ./report.md)")
    else:
        exit_with(BadValue(f"unknown command {cmd!r}: python -m nanochat.report reset|generate"))
