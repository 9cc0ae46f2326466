"""curves.png: a grid of titled panels with units, held-out accuracy before/after with error bars,
and the AQN sigma with its stages, rendered from a metrics.jsonl."""

import json

import pytest

from qerl.cli.plot import COLUMNS, figure, plot


def write_run(folder, adaptive=False):
    rows = [{"step": 0, "eval_pass_at_1": 0.10, "eval_stderr": 0.015}]
    for s in range(12):
        st = s * 3 // 12
        r = {"step": s, "aqn_stage": st, "sigma": [0.0, 1e-2, 5e-4][st], "aqn_sigma_effective": [0.0, 1e-2, 5e-4][st],
             "reward_mean": 0.1 + s / 40, "accuracy": 0.1 + s / 40, "entropy": 2.0 - s / 20, "rollout_entropy": 2.1 - s / 20,
             "completion_length_mean": 30 - s, "completion_length_max": 48, "logprob_mismatch_mean": 0.03,
             "logprob_mismatch_max": 0.3, "loss": 0.05, "grad_norm": 0.3, "filtered_group_fraction": 0.5,
             "time_step": 4.0, "time_rollout": 2.0, "time_update": 1.5}
        if adaptive:
            r.update(aqn_signal=1.5 + s / 30, aqn_target=1.8)
        rows.append(r)
    rows.append({"step": 11, "eval_pass_at_1": 0.25, "eval_stderr": 0.02})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_curves_png_is_a_grid_rendered_from_metrics_jsonl(tmp_path):
    import matplotlib.image as mpimg

    write_run(tmp_path / "run")
    out = plot(tmp_path / "run")
    assert out == tmp_path / "run" / "curves.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    h, w = mpimg.imread(out).shape[:2]
    assert h > 0.5 * w  # rows of panels, not one strip of eight


def test_every_panel_has_a_title_and_units_and_the_key_ones_are_there(tmp_path):
    rows = write_run(tmp_path / "run")
    fig = figure(rows)
    axes = [a for a in fig.axes if a.get_visible()]
    assert len(axes) == 10 and len(fig.axes) % COLUMNS == 0
    assert all(a.get_title() and a.get_ylabel() for a in axes)
    titles = [a.get_title() for a in axes]
    assert titles[0] == "held-out pass@1: +15.0 points" and titles[1] == "AQN noise σ by stage"
    # before / after bars with ±1 standard error, in %
    ev = axes[0]
    assert [round(b.get_height(), 6) for b in ev.patches] == [10.0, 25.0]
    (errbar,) = [c for c in ev.containers if c.__class__.__name__ == "ErrorbarContainer"]
    segs = errbar.lines[2][0].get_segments()
    assert [round(s[1][1] - s[0][1], 6) for s in segs] == [3.0, 4.0]  # 2 x 1.5 and 2 x 2.0 points
    # the stages are labelled on the sigma panel
    labels = [t.get_text() for t in axes[1].texts]
    assert labels == ["stage 0", "stage 1", "stage 2"]


def test_adaptive_aqn_shows_its_signal_and_target(tmp_path):
    rows = write_run(tmp_path / "run", adaptive=True)
    fig = figure(rows)
    twins = [a for a in fig.axes if a.get_ylabel() == "controlled signal"]
    assert len(twins) == 1 and len(twins[0].lines) == 2


def test_an_empty_run_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="metrics.jsonl is empty"):
        plot(tmp_path)
