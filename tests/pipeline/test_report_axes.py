"""``labrl report``: step on x by default, wall time monotone across resumes, labelled axes, error rates."""

from __future__ import annotations

import json

from labrl.cli import main
from labrl.harness.report import X_LABELS, label_accuracy, monotone_time, write_report


def write_run(run_dir, times):
    rows = []
    for step, t in enumerate(times, start=1):
        rows.append(
            {
                "step": step, "time_s": t, "mode": "pipeline", "reward/mean": 0.1 * step,
                "reward/accuracy": 0.05 * step, "episodes/finished": 10, "errors/env_error_frac": 0.2,
                "errors/verifier_failed_frac": 0.1 if step == 2 else 0.0, "errors/timeout_frac": 0.0,
                "staleness/hist": {"0": 3, "1": 1}, "throughput/tokens_per_s": 100.0,
            }
        )  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": 0, "accuracy": 0.25, "time_s": 5.0}, {"step": 4, "accuracy": 0.75, "time_s": 30.0}]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))


def test_wall_time_of_a_resumed_run_never_goes_back():
    # a run resumed twice by a labrl that restarted time_s at 0 each time
    assert monotone_time([10, 20, 3, 8, 1]) == [10, 20, 20, 25, 25]
    assert monotone_time([1, 2, 3]) == [1, 2, 3]


def test_plots_are_against_the_step_with_both_axes_labelled_and_show_error_rates(tmp_path, capsys):
    write_run(tmp_path, [10.0, 20.0, 3.0, 9.0])
    report = write_report(tmp_path)
    assert set(report.axes) == {
        "reward",
        "errors",
        "staleness",
        "is_ratio",
        "masked",
        "env_latency",
        "throughput",
        "groups",
    }
    for name, (xlabel, ylabel) in report.axes.items():
        assert xlabel and ylabel, name
        if name != "staleness":  # a histogram over staleness values
            assert xlabel == X_LABELS["step"] == "learner step", name
    assert report.axes["reward"][1] == "reward / accuracy"
    assert "failed episodes: env_error 0.200, verifier_failed 0.025, timeout 0.000" in report.summary

    assert main(["report", str(tmp_path), "--x", "time", "--out", str(tmp_path / "t")]) == 0
    assert "failed episodes: env_error 0.200" in capsys.readouterr().out
    timed = write_report(tmp_path, tmp_path / "t", x="time")
    assert timed.axes["reward"][0] == "wall-clock of training (min)"


def test_groups_dropped_are_told_apart_as_all_correct_and_all_wrong(tmp_path):
    write_run(tmp_path, [1.0, 2.0])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r, (kept, correct, wrong) in zip(rows, [(8, 1, 5), (16, 3, 11)], strict=True):
        r.update({"groups/kept_total": kept, "groups/zero_variance_total": correct + wrong,
                  "groups/all_correct_total": correct, "groups/all_wrong_total": wrong})  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(tmp_path)
    assert "groups: 16 kept, 14 zero-variance dropped (3 all-correct, 11 all-wrong)" in report.summary
    assert report.axes["groups"] == ("learner step", "groups")


def test_per_label_accuracy_is_plotted_and_labels_never_answered_are_named(tmp_path, capsys):
    write_run(tmp_path, [10.0, 20.0, 30.0, 40.0])
    first = {
        "CaSi6_166": {"n": 40, "accuracy": 0.5, "answers": {"CaSi6_166": 20, "Ne_225": 20}},
        "Ne_225": {"n": 40, "accuracy": 0.75, "answers": {"Ne_225": 30, "CaSi6_166": 10}},
        "Os_194": {"n": 48, "accuracy": 1.0, "answers": {"Os_194": 48}},
    }
    last = {
        "CaSi6_166": {"n": 40, "accuracy": 0.0, "answers": {"NaTl_227": 13, "Ne_225": 26, "(unparsed)": 1}},
        "Ne_225": {"n": 40, "accuracy": 1.0, "answers": {"Ne_225": 40}},
        "Os_194": {"n": 48, "accuracy": 0.0, "answers": {"Ne_225": 48}},
        "NaTl_227": {"n": 1, "accuracy": 1.0, "answers": {"NaTl_227": 1}},
    }
    evals = [
        {"step": 0, "accuracy": 0.77, "time_s": 5.0, "by_label": first},
        {"step": 4, "accuracy": 0.32, "time_s": 30.0, "by_label": last},
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))

    assert label_accuracy(evals) == {
        "CaSi6_166": ([0.0, 4.0], [0.5, 0.0]),
        "Ne_225": ([0.0, 4.0], [0.75, 1.0]),
        "Os_194": ([0.0, 4.0], [1.0, 0.0]),
        "NaTl_227": ([4.0], [1.0]),
    }
    report = write_report(tmp_path)
    assert report.axes["by_label"] == ("learner step", "held-out accuracy")
    line = (
        "never answered at step 4: CaSi6_166 (answered as Ne_225 26, NaTl_227 13, (unparsed) 1), "
        "Os_194 (answered as Ne_225 48)"
    )
    assert report.summary.splitlines()[-1] == line

    assert main(["report", str(tmp_path)]) == 0
    assert line in capsys.readouterr().out.splitlines()


def test_a_labelled_run_with_every_label_answered_says_so(tmp_path):
    write_run(tmp_path, [10.0, 20.0])
    cells = {"Ne_225": {"n": 2, "accuracy": 0.5, "answers": {"Ne_225": 1, "Os_194": 1}},
             "Os_194": {"n": 1, "accuracy": 0.0, "answers": {"Ne_225": 1}}}  # fmt: skip
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 2, "accuracy": 0.3, "by_label": cells}) + "\n")
    report = write_report(tmp_path, x="time")
    assert report.summary.splitlines()[-1] == "never answered at step 2: none (every label of 2 named)"
    assert report.axes["by_label"][0] == X_LABELS["time"]


def test_the_time_to_reach_the_target_accuracy_is_told_in_training_minutes():
    from labrl.harness.report import time_to_accuracy

    evals = [
        {"step": 0, "accuracy": 0.2, "time_s": 30.0},
        {"step": 20, "accuracy": 0.91, "time_s": 300.0},
        {"step": 40, "accuracy": 0.95, "time_s": 20.0},  # after a resume whose clock restarted
    ]
    assert time_to_accuracy(evals) == "held-out accuracy >= 0.9 first at step 20, 5.0 min of training"
    assert time_to_accuracy(evals, target=0.93) == (
        "held-out accuracy >= 0.93 first at step 40, 5.0 min of training"
    )
    assert time_to_accuracy(evals[:1]) == (
        "held-out accuracy never >= 0.9: best 0.200 at step 0, 0.5 min of training"
    )
    assert time_to_accuracy([]) is None
