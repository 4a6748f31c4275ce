"""dilu demo, compare and chaos refuse option combinations that would mean nothing, in one line
and before anything starts (no NATS, no service is started for them)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from cli_errors import one_line_error
from dilu.cli.main import main


@pytest.mark.parametrize("args, words", [
    (["demo", "--gpus", "1", "--training-jobs", "2"], "at most one training job per GPU: 2 on 1 GPUs"),
    (["compare", "--gpus", "2", "--training-jobs", "3"], "at most one training job per GPU"),
    (["chaos", "--soak", "--faults", "kill-scheduler"], "--faults does not apply"),
    (["chaos", "--sample-s", "30"], "it needs --soak"),
])
def test_a_combination_that_means_nothing_is_refused_in_one_line(args, words):
    assert words in one_line_error(CliRunner().invoke(main, args), 2)


def test_one_training_job_per_gpu_and_a_cpu_node_are_accepted():
    from dilu.cli.demo import RunOptions

    base = dict(duration=10.0, speedup=10.0, seed=1, trace_dir=None, start_minute=None, functions=4,
                nats_url=None, log_dir=None)
    assert RunOptions(**base, gpus="4", training_jobs=4).training_count() == 4
    assert RunOptions(**base, gpus="cpu", training_jobs=3).training_count() == 0
