"""The result of a conformance run: the worst error of a quantity, a row, the report."""

import dataclasses

import numpy as np


def worst_error(got, want):
    """Largest absolute difference; infinite for NaN, a wrong shape or mismatched infinities."""
    want = np.asarray(want, dtype=np.float64)
    try:
        got = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        return np.inf, f"not an array of numbers: {type(got).__name__}"
    if got.shape != want.shape:
        return np.inf, f"shape {got.shape}, expected {want.shape}"
    if np.isnan(got).any():
        return np.inf, "NaN in result"
    finite = np.isfinite(want)
    if (got[~finite] != want[~finite]).any() or not np.isfinite(got[finite]).all():
        return np.inf, "infinities differ from the oracle's"
    if not finite.any():
        return 0.0, ""
    return float(np.max(np.abs(got[finite] - want[finite]))), ""


def _magnitude(want):
    want = np.asarray(want, dtype=np.float64)
    finite = want[np.isfinite(want)]
    return float(np.max(np.abs(finite))) if finite.size else 0.0


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of a report: a quantity of one case in one dtype."""

    case: str
    dtype: str
    quantity: str
    error: float
    allowed: float
    passed: bool
    note: str = ""
    baseline: float = float("nan")  # error of the naive evaluation in the same dtype


@dataclasses.dataclass
class ConformanceReport:
    """The result of a conformance run: true when every row passed.

    Attributes
    ----------
    title : str
        What was checked.
    rows : list of Row
        One per case, dtype and quantity compared.
    skipped : list of (str, list of str)
        Cases not run and the options or capabilities they needed.
    strict : bool
        Whether a skipped case fails the run (`check_attention`'s ``strict``).
    """

    title: str
    rows: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)
    strict: bool = False

    def __bool__(self):
        if self.strict and self.skipped:
            return False
        return bool(self.rows) and all(r.passed for r in self.rows)

    @property
    def failures(self):
        """The rows that failed."""
        return [r for r in self.rows if not r.passed]

    @property
    def failed_cases(self):
        """Names of the cases with at least one failed row."""
        return sorted({r.case for r in self.failures})

    def __str__(self):
        width = max([len(r.case) for r in self.rows] + [4])
        named = max([len(r.quantity) for r in self.rows] + [8])
        lines = [self.title,
                 f"  {'case':<{width}}  {'dtype':<7}  {'quantity':<{named}}  {'worst error':>11}  "
                 f"{'allowed':>9}  result"]
        for r in self.rows:
            lines.append(
                f"  {r.case:<{width}}  {r.dtype:<7}  {r.quantity:<{named}}  {r.error:>11.2e}  "
                f"{r.allowed:>9.2e}  {'pass' if r.passed else 'FAIL'}"
                + (f"  ({r.note})" if r.note else "")
            )
        if not self.rows:
            lines.append("  (nothing was run)")
        passed = sum(r.passed for r in self.rows)
        summary = f"  {passed}/{len(self.rows)} passed"
        if self.skipped:
            summary += f", {len(self.skipped)} case{'s' if len(self.skipped) != 1 else ''} skipped"
            summary += " (strict: a skipped case fails)" if self.strict else ""
        lines.append(summary)
        if self.skipped:
            lines.append("  skipped: " + "; ".join(
                f"{name} (needs {', '.join(needs)})" for name, needs in self.skipped))
        return "\n".join(lines)
