"""gpu-check's output directory may already hold the microbatch probe's measured record of the same
device: gpu-check accepts it without a question and leaves it as it was; anything else is refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpipe_repro.repro.gpu_check.report import OutputRefused, check_out_dir


def test_the_probe_record_may_share_the_device_directory(tmp_path: Path) -> None:
    out = tmp_path / "nvidia-h100"
    out.mkdir()
    probe = out / "probe_gpu_microbatches.json"
    probe.write_text('{"method": "measured"}')
    check_out_dir(out)                                   # no question, no refusal
    assert probe.read_text() == '{"method": "measured"}'
    (out / "holiday.png").write_bytes(b"\x89PNG")
    with pytest.raises(OutputRefused, match="holds no gpu-check"):
        check_out_dir(out)
