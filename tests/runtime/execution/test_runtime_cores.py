"""The oversubscription message: CPU ranks that need more cores than the host gives them."""
from __future__ import annotations

import logging

import pytest

from fxpipe.runtime.execution.cores import oversubscription, usable_cores, warn_if_oversubscribed


@pytest.mark.parametrize("ranks,threads,cores,fits", [
    (2, 1, 2, True), (4, 1, 4, True), (3, 1, 2, False), (2, 2, 2, False), (1, 8, 8, True),
])
def test_ranks_times_threads_against_cores(ranks: int, threads: int, cores: int,
                                           fits: bool) -> None:
    msg = oversubscription(ranks, threads, cores)
    assert (msg is None) == fits
    if not fits:  # names the counts and what to do
        assert f"{ranks} CPU ranks x {threads} thread(s) share {cores} core(s)" in msg
        assert f"run at most {cores} ranks per host" in msg


def test_only_cpu_ranks_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    many = usable_cores() + 1
    with caplog.at_level(logging.WARNING, logger="fxpipe.runtime.execution.cores"):
        assert warn_if_oversubscribed(many, "cuda", threads=1) is None
        assert not caplog.records
        assert warn_if_oversubscribed(many, "cpu", threads=1) is not None
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert f"{many} CPU ranks x 1 thread(s)" in caplog.records[0].getMessage()
    assert warn_if_oversubscribed(usable_cores(), "cpu", threads=1) is None
