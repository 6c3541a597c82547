"""The report card: sections, summary table across stages, curves drawn as PNG next to report.md."""

import os

from nanochat.report import Report, extract_metrics


def test_report_sections_summary_and_curves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = Report(str(tmp_path / "report"))
    r.reset()
    r.log("Base model training", [{"depth": 4}, {"Minimum validation bpb": 1.2345678}])
    r.log("Base model evaluation", [{"CORE metric": 0.0123}])
    r.log("Chat evaluation sft", [{"ARC-Easy": 0.31, "GSM8K": 0.02, "ChatCORE metric": 0.05}])
    r.log("Chat evaluation mid", [{"ARC-Easy": 0.29}])
    r.log_curve("Base training loss", [1, 2, 3], [5.0, 4.0, 3.5], ylabel="loss")
    out = r.generate()
    text = open(out).read()
    # sections in pipeline order, whatever order they were logged in
    assert text.index("## Base model training") < text.index("## Chat evaluation mid") < text.index("## Chat evaluation sft")
    assert "- Minimum validation bpb: 1.2346" in text
    assert "| CORE | 0.0123 | - | - | - |" in text
    assert "| ARC-Easy | - | 0.2900 | 0.3100 | - |" in text
    assert "| ChatCORE | - | - | 0.0500 | - |" in text
    png = tmp_path / "report" / "curve-base-training-loss.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![Base training loss](curve-base-training-loss.png)" in text
    # the copy in the working directory points at the images where they are
    cwd_text = (tmp_path / "report.md").read_text()
    assert f"]({png})" in cwd_text


def test_reset_clears_previous_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = Report(str(tmp_path / "report"))
    r.log("Chat RL", [{"x": 1}])
    r.reset()
    assert sorted(os.listdir(tmp_path / "report")) == ["header.md", "start_time.json"]


def test_extract_metrics():
    assert extract_metrics("## X\n- a: 1\n- b c: 0.5\nnot: this\n") == {"a": "1", "b c": "0.5"}
