"""SGLang against the torch backend on a config-built Qwen2-shaped model (random weights):
greedy ids equal up to near-ties, logprobs close; the same weight update changes both the same
way; a stale update is refused; the checksum debug path finds the new weights on the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.common import needs_cuda, needs_sglang, run_check, run_json

pytestmark = [needs_cuda, needs_sglang, pytest.mark.gpu, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen2-shape") / "model"
    rc, text = run_check("build-model", str(out), "--layers", "4", timeout_s=600)
    assert rc == 0, text[-4000:]
    return out


def test_sglang_matches_the_torch_backend(model_dir: Path, tmp_path: Path) -> None:
    res = run_json(tmp_path / "parity.json", "parity", "--engine", "sglang",
                   "--model", str(model_dir))
    for phase in ("before", "after"):
        assert not res[phase]["mismatches"], res[phase]
        assert res[phase]["max_lp_diff"] <= 0.15, res[phase]
    assert res["updated"] and res["ref_updated"] and res["stale_refused"]
    assert res["engine_changed"] > 0 and res["ref_changed"] > 0
    assert res["versions_after"] == [1]
    assert res["checksum"]["ok"], res["checksum"]["summary"]
    assert res["ok"]
