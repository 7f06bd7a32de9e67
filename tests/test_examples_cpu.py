"""The CPU examples (examples/*_cpu.py) run as written and show what their docstrings say, both ways.

Run in this process (``runpy``) to share the frameworks' imports: each example's ``main(argv)`` is what
``python examples/<name>.py [--bf16]`` runs. Accelerate's process-wide state is reset around each run,
as two Accelerators of different precision in one process need.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from ampwatch_support.framework_truth import fresh_state  # noqa: F401 (a fixture)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
README = Path(__file__).resolve().parents[1] / "README.md"

# example -> (what the float16 run with a GradScaler says, what the bf16 run without one says)
EXPECTED = {
    "plain_loop_cpu": ("AdamW: 6 stepped, 2 skipped",
                     "AdamW: 8 stepped, 0 skipped (longest streak 0, now 0), 5 poisoned"),
    "lightning_cpu": ("AdamW: 6 stepped, 2 skipped",
                    "AdamW: 8 stepped, 0 skipped (longest streak 0, now 0), 5 poisoned"),
    "transformers_cpu": ("AdamW: 7 stepped, 1 skipped",
                       "AdamW: 8 stepped, 0 skipped (longest streak 0, now 0), 6 poisoned"),
    "accelerate_cpu": ("AdamW: 6 stepped, 2 skipped",
                     "AdamW: 8 stepped, 0 skipped (longest streak 0, now 0), 5 poisoned"),
}

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_cpu_example_reports_its_skip_with_a_scaler_and_its_poisoned_steps_in_bf16(name, fresh_state, capsys,
                                                                                         tmp_path):
    from ampwatch_support.framework_truth import reset_accelerate_state

    fresh_state.chdir(tmp_path)
    main = runpy.run_path(str(EXAMPLES / f"{name}.py"))["main"]
    for argv, expected in (([], EXPECTED[name][0]), (["--bf16"], EXPECTED[name][1])):
        reset_accelerate_state()
        main(argv)
        said = capsys.readouterr().out
        assert expected in said, said
        assert ("no GradScaler" in said) == bool(argv), said


def test_the_readme_links_every_cpu_example():
    text = README.read_text()
    for name in EXPECTED:
        assert f"(examples/{name}.py)" in text
