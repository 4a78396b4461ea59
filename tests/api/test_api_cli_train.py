"""`fxpipe train --data digits`: scikit-learn's digits shaped for any zoo classifier."""
from __future__ import annotations

import pytest
import torch

from fxpipe.cli_train import digits_for
from fxpipe.errors import ConfigError


def test_digits_as_vectors_and_as_images() -> None:
    x, y = digits_for((4, 64), "mlp")
    assert x.shape == (1797, 64) and y.shape == (1797,) and y.dtype == torch.long
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    images, labels = digits_for((4, 3, 32, 32), "vgg16")
    assert images.shape == (1797, 3, 32, 32) and torch.equal(labels, y)
    assert torch.equal(images[:, 0], images[:, 2])  # the grey image on every channel


def test_digits_for_a_model_that_is_no_image_classifier() -> None:
    with pytest.raises(ConfigError, match=r"s2vt takes inputs of shape \(4, 8, 64\)"):
        digits_for((4, 8, 64), "s2vt")


def test_pilot_options_reach_auto_and_the_workers() -> None:
    """--pilot, --pilot-on and --look-again become auto_options (only those given) and travel
    to the ranks."""
    import argparse

    from fxpipe.cli_train import _add_arguments, _worker_argv, auto_options

    p = argparse.ArgumentParser()
    _add_arguments(p)
    assert auto_options(p.parse_args(["mlp", "--data", "synthetic"])) == {}
    args = p.parse_args(["mlp", "--data", "synthetic", "--pilot", "40", "--pilot-on", "pipeline",
                         "--look-again", "0"])
    assert auto_options(args) == {"pilot": 40, "where": "pipeline", "look_again": 0.0}
    argv = _worker_argv(args)
    assert argv[argv.index("--pilot-on") + 1] == "pipeline"
    assert argv[argv.index("--look-again") + 1] == "0.0"
    with pytest.raises(SystemExit):
        p.parse_args(["mlp", "--data", "synthetic", "--pilot-on", "gpu"])


def test_the_plan_is_made_for_the_schedule_named() -> None:
    from fxpipe.cli_train import plan_schedule

    assert [plan_schedule(s) for s in ("1f1b-flush", "zb-h2", "2bw", "gpipe", "pipedream+predict",
                                       "auto", "interleaved-1f1b")] == \
        ["1f1b-flush", "zb-h2", "2bw", "gpipe", "pipedream", "auto", "pipedream"]


def test_a_users_model_without_a_model_spec_is_refused_before_torchrun(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--data synthetic`` needs a batch maker and a loss: a factory returning a bare module
    (now with ``--input-shape``, which ``fxpipe train`` takes like ``plan``) or ``(model,
    example_inputs)`` is refused in the launcher, naming what a ModelSpec carries, before any
    process starts (the launcher returns 2 at once: no torchrun output)."""
    from fxpipe.cli import main

    f = tmp_path / "mine.py"
    f.write_text("import torch\n"
                 "def bare():\n    return torch.nn.Linear(8, 2)\n"
                 "def pair():\n    return torch.nn.Linear(8, 2), (torch.randn(4, 8),)\n")
    for factory, extra in (("bare", ["--input-shape", "4,8"]), ("pair", [])):
        assert main(["train", f"{f}:{factory}", "--data", "synthetic", "--nproc", "2",
                     *extra]) == 2
        err = capsys.readouterr().err
        assert "comes with no batch maker for --data synthetic" in err
        assert "return fxpipe.models.ModelSpec(name=..., size='custom', model=model" in err
        assert "--data file.py:loaders" in err
    assert main(["train", f"{f}:bare", "--data", "synthetic", "--nproc", "2"]) == 2
    assert "fxpipe needs --input-shape" in capsys.readouterr().err  # and the option exists


def test_train_prices_the_plan_for_the_links_it_is_told() -> None:
    import argparse

    from fxpipe.cli_train import _add_arguments, _worker_argv

    p = argparse.ArgumentParser()
    _add_arguments(p)
    args = p.parse_args(["mlp", "--data", "synthetic", "--bandwidth", "1Gbps"])
    argv = _worker_argv(args)
    assert argv[argv.index("--bandwidth") + 1] == "1Gbps"
    assert p.parse_args(["mlp", "--data", "synthetic"]).bandwidth == "10Gbps"


def test_localsgd_and_sharding_options_travel_to_the_workers() -> None:
    import argparse

    from fxpipe.cli_train import _add_arguments, _worker_argv

    p = argparse.ArgumentParser()
    _add_arguments(p)
    args = p.parse_args(["mlp", "--data", "synthetic", "--schedule", "localsgd",
                         "--average-every", "8", "--shard", "optimizer"])
    argv = _worker_argv(args)
    assert argv[argv.index("--average-every") + 1] == "8"
    assert argv[argv.index("--shard") + 1] == "optimizer"
    with pytest.raises(SystemExit):
        p.parse_args(["mlp", "--data", "synthetic", "--shard", "params"])
    for choice in ("never", "auto"):
        got = p.parse_args(["mlp", "--data", "synthetic", "--shard", choice])
        assert got.shard == choice
    assert p.parse_args(["mlp", "--data", "synthetic"]).shard is None
