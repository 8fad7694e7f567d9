"""The one exception users see: a sentence naming the problem and what to do."""


class MoECompressError(Exception):
    """Bad input or an unsupported situation. The CLI prints the message alone and exits 2."""

    exit_code = 2


class NonFiniteMetrics(MoECompressError):
    """An evaluation produced NaN or infinite metrics (broken weights, not bad options): exit 1, one sentence.

    Not exit 0, because `ppl nan` reported as success hides a broken checkpoint; not exit 2, because the
    command line itself was fine. `--allow-nan` keeps such results instead."""

    exit_code = 1


class BudgetExceeded(MoECompressError):
    """The weight files an export wrote are larger than the budget its plan records (`auto`'s hard upper bound,
    `export.budget.check_weight_budget`): exit 1, one sentence, nothing left behind. Not exit 2: the command line
    was fine, the output did not fit."""

    exit_code = 1
