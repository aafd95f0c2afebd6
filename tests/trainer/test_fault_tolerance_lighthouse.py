"""A Lighthouse that does not answer is one line naming its address after
``--fault_tolerance.lighthouse_timeout_seconds`` (issue 30, item 11), before the model is built."""
import socket
import time

import pytest

from trainer import train
from trainer.config import parse_args
from trainer.run.fault_tolerance import wait_for_lighthouse
from trainer.errors import TrainingError
from tests.trainer.helpers import config_error

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: nothing listens there


def test_wait_for_lighthouse_times_out_in_one_line_naming_the_address():
    address = f"http://127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(TrainingError) as info:
        wait_for_lighthouse(address, 1.0)
    took = time.monotonic() - t0
    msg = str(info.value)
    assert 0.5 <= took < 5, took
    assert "\n" not in msg and address in msg and "within 1s (--fault_tolerance.lighthouse_timeout_seconds)" in msg
    for bad in ("http://127.0.0.1", "not a url:xx"):
        with pytest.raises(TrainingError, match="is not an address http://HOST:PORT"):
            wait_for_lighthouse(bad, 1.0)
    with pytest.raises(TrainingError, match="set TORCHFT_LIGHTHOUSE"):
        wait_for_lighthouse("", 1.0)
    with socket.socket() as server:  # a port that accepts and never replies is no Lighthouse
        server.bind(("127.0.0.1", 0))
        server.listen()
        with pytest.raises(TrainingError, match="no Lighthouse answers at .* timed out"):
            wait_for_lighthouse(f"http://127.0.0.1:{server.getsockname()[1]}", 1.0)
    torchft = pytest.importorskip("torchft", reason="a real Lighthouse needs torchft (the [test] extra)")
    lighthouse = torchft._torchft.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:  # a Lighthouse answers at once
        t0 = time.monotonic()
        wait_for_lighthouse(lighthouse.address(), 5.0)
        assert time.monotonic() - t0 < 2
    finally:
        lighthouse.shutdown()
    assert "lighthouse_timeout_seconds: expected a finite value > 0" in config_error(
        ["--fault_tolerance.enable", "--fault_tolerance.group_size", "1", "--fault_tolerance.lighthouse_timeout_seconds",
         "0"])


def test_a_run_with_no_lighthouse_stops_in_one_line_before_the_build(tmp_path, monkeypatch, capsys):
    address = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address)
    config = parse_args(["--fault_tolerance.enable", "--fault_tolerance.group_size", "1", "--training.steps", "1",
                         "--fault_tolerance.lighthouse_timeout_seconds", "1", "--job.dump_folder", str(tmp_path)])
    t0 = time.monotonic()
    assert train.main(config) == 1
    err = capsys.readouterr().err
    assert time.monotonic() - t0 < 30
    assert err.count("\n") == 1 and address in err and "no Lighthouse answers" in err, err
