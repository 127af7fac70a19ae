"""Write the FineTune CRD into the kubetune-operator chart, from the code that generates it.

    .venv/bin/python scripts/chart_crds.py            # write charts/kubetune-operator/crds/
    .venv/bin/python scripts/chart_crds.py --check    # exit 1, naming the file, if the chart's copy differs

One source of truth: kubetune.operator.crd builds the CRD from the recipe schema (`kubetune operator crd` prints
it, src/kubetune/operator/crds/ holds the packaged copy). The chart needs a file of its own because Helm installs
only the files under a chart's crds/ directory as CRDs (before the templates, on first install); it cannot
reference a file outside the chart. tests/charts/test_operator_chart.py fails when the copy drifts.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHART_CRDS = Path(__file__).resolve().parents[1] / "charts" / "kubetune-operator" / "crds"


def expected() -> dict[Path, str]:
    from kubetune.operator.crd import CRD_FILE, crd_yaml

    return {CHART_CRDS / CRD_FILE: crd_yaml()}


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = [path for path, text in expected().items() if not path.is_file() or path.read_text() != text]
    if check:
        for path in stale:
            print(f"{path}: differs from kubetune.operator.crd; run scripts/chart_crds.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in expected().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
