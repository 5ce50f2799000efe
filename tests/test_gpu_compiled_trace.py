"""graphsan's own GPU-trace interpreter on a GPU (GRAPHSAN_TRACELOG=1; the program builds the
library on first use): temporaries reach no Python, a watched free is judged with both sites, and
a later takeover by PyTorch's trace loses nothing."""

from __future__ import annotations

import pytest

from tests.gpu_programs import run_program

pytestmark = pytest.mark.gpu


def test_the_compiled_trace_judges_watched_frees_and_only_those():
    rc, result, log = run_program(
        "compiled_trace", policy="raise", env={"GRAPHSAN_TRACELOG": "1"}, timeout=400
    )
    assert rc == 0 and result is not None, log[-3000:]
    assert result["allocator_log"] == "tracker" and result["installed"], result
    assert result["python_calls_for_temporaries"] == 0, result
    assert result["replay"] == "raised", result
    text = result["first_text"]
    assert "make_weight" in text and "drop" in text, text  # allocation and free sites
    # PyTorch's interpreter replaced graphsan's: one warning, then frees through PyTorch's trace
    assert len(result["takeover_warnings"]) == 1, result["takeover_warnings"]
    assert result["allocator_log_after"].startswith("tracker, GPU trace: PyTorch's ("), result
    assert result["replay2"] == "raised" and "drop" in result["second_text"], result
    assert result["healthy"]
